"""`pagedcli chat` as a script runs it (stdin piped), and prompts read from standard input by generate."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ASSETS

TEMPLATE = ASSETS / "chat" / "chat_template.jinja"
STATS = re.compile(r"turn (\d+): ([\d,]+) of ([\d,]+) prompt tokens from cached blocks, (\d+) blocks? a layer, ([\d,]+) free")


def invoke(*args, input: str | bytes = "") -> tuple[int, str, str]:
    """`pagedcli *args` in-process with `input` piped to its stdin (CliRunner's stdin is no terminal)."""
    from typer.testing import CliRunner

    from pagedcli.commands.app import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exit_code == 1 and result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def requests(monkeypatch):
    """Every sequence the engine is given, in order."""
    from pagedcli.engine.engine import Engine

    seqs, add = [], Engine.add_request

    def record(self, *args, **kwargs):
        seqs.append(add(self, *args, **kwargs))
        return seqs[-1]

    monkeypatch.setattr(Engine, "add_request", record)
    return seqs


def chat(model, lines: str, *args):
    return invoke("chat", "--model", model, "--chat-template", TEMPLATE, "--temperature", "0", "--max-tokens", "20",
                  *args, input=lines)


def stats(err: str) -> list[tuple[int, ...]]:
    return [tuple(int(g.replace(",", "")) for g in m.groups()) for m in STATS.finditer(err)]


# --- chat -----------------------------------------------------------------------------------------
def test_a_second_turn_extends_the_first_and_is_served_from_its_blocks(stories, requests, make_engine):
    from pagedcli.core.options import DEFAULT_CACHE
    from pagedcli.core.options import SamplingParams
    from pagedcli.model.tokenizer import StreamDecoder, Tokenizer

    code, out, err = chat(stories, "Hello!\nWhat did I just say?\n")
    assert code == 0, err
    first, second = requests
    tok = Tokenizer(stories)
    # stdout: the two answers as streamed, each ending its line, and nothing else
    answers = [StreamDecoder(tok, s.prompt_token_ids).catch_up(s.output_token_ids) for s in (first, second)]
    assert out == "".join(a + "\n" for a in answers) and all(a.strip() for a in answers)
    # one sequence: the first turn's ids as generated, then only the new text encoded
    assert second.prompt_token_ids[:len(first)] == first.token_ids
    assert second.prompt_token_ids[len(first):] == tok.encode_rendered("</s>\n[user]\nWhat did I just say?</s>\n[assistant]\n")
    assert first.prompt_token_ids == tok.encode_rendered("<s>[user]\nHello!</s>\n[assistant]\n")
    # the second turn's prompt: every full block of the first turn's fed tokens came from the cache
    (t1, c1, p1, _, _), (t2, c2, p2, blocks, free) = stats(err)
    assert (t1, c1, p1) == (1, 0, len(first.prompt_token_ids))
    fed = first.num_cached  # its last token, sampled at a length limit, was never fed
    assert t2 == 2 and p2 == len(second.prompt_token_ids) and c2 == fed // 16 * 16 > 0
    assert blocks == -(-second.num_cached // 16)
    # the prefix cache changes nothing: a fresh engine, without it, answers the same ids alike
    fresh = make_engine(stories, prefix_caching=False).engine
    again = fresh.run_to_completion([second.prompt_token_ids], SamplingParams(max_tokens=20))[0]
    assert again.output_token_ids == second.output_token_ids
    # nothing held once the turn ended: every block of the command's (default) pool is free
    assert free == make_engine(stories, cache_size=DEFAULT_CACHE["cpu"]).engine.cache.num_free_blocks


def test_reset_starts_a_new_conversation_whose_repeats_the_cache_still_serves(stories, requests):
    code, _, err = chat(stories, "Once upon a time there was a little girl named Lily\n/reset\n"
                        "Once upon a time there was a little girl named Lily\n", "--system", "Tell a story.")
    assert code == 0, err
    first, again = requests
    assert again.prompt_token_ids == first.prompt_token_ids  # not the first turn's answer and more
    (t1, c1, _, _, _), (t2, c2, p2, _, _) = stats(err)
    assert (t1, c1) == (1, 0) and t2 == 1 and c2 == (p2 - 1) // 16 * 16 > 0


def test_a_conversation_that_outgrows_the_length_limit_ends_in_one_line(stories, requests):
    code, out, err = chat(stories, "Hello!\nWhat did I just say?\nAnd then?\n", "--max-model-len", "64")
    assert code == 1 and len(requests) == 1 and out.count("\n") >= 1
    line = err.strip().splitlines()[-1]
    # from a pipe the run ends there: the way out is room (/reset is a terminal's)
    assert line.startswith("error: turn 2: the conversation would be") and "/reset" not in line
    assert line.endswith("(--max-model-len can make room)") and "Traceback" not in err


def test_a_message_past_what_the_pool_holds_says_the_pool_can_grow(stories, requests):
    code, _, err = chat(stories, "Once upon a time " * 60 + "\n", "--num-blocks", "50")  # 160 tokens a layer
    line = err.strip().splitlines()[-1]
    assert code == 1 and not requests and "159 is the most a prompt can be here" in line, err
    assert line.endswith("(--cache-size or --num-blocks can make room)"), line


def test_a_message_past_the_models_own_positions_says_only_a_shorter_one_fits(stories, requests):
    """At the model's max_position_embeddings neither --max-model-len nor --cache-size can help."""
    code, _, err = chat(stories, "Once upon a time " * 200 + "\n")
    line = err.strip().splitlines()[-1]
    assert code == 1 and not requests and line.startswith("error: turn 1: the conversation would be"), err
    assert line.endswith("(a shorter message can fit (the model's positions end there))"), line


def test_a_model_without_a_chat_template_is_refused_in_one_line(stories):
    code, out, err = invoke("chat", "--model", stories, input="Hello!\n")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: model {stories} has no chat template (give one with --chat-template "
                                         "FILE, a Jinja file such as a chat model's chat_template.jinja)"]


def test_commands_and_blank_lines_are_not_turns(stories, requests):
    code, out, err = chat(stories, "\n/cache\n   \n/bogus\n/live\nHello!\n/exit\nnever read\n")
    assert code == 0 and len(requests) == 1 and [s[0] for s in stats(err)] == [1]
    assert "nothing to show yet" in err and "error: /bogus is not a command" in err
    assert "/live: stdout is not a terminal, so no live view" in err and "╭" not in out


def test_cache_shows_the_conversations_block_table(stories, requests):
    code, out, _ = chat(stories, "Hello!\n/cache\n", "--block-size", "8")
    (seq,) = requests
    assert code == 0
    table = out[out.index("slot "):]  # as the step before the answer's last left it
    n = len(seq) - 1
    assert f"tokens    {n} ({len(seq.prompt_token_ids)} prompt + {n - len(seq.prompt_token_ids)} output), " \
           f"{n - 1} in the cache, in {-(-n // 8)} blocks a layer" in table
    assert "│ [user]\\n " in table and "│ Hello! \\n" in table  # each block's text (</s> is not shown)


def test_at_a_terminal_messages_are_typed_at_a_prompt(stories, requests, monkeypatch):
    monkeypatch.setattr("pagedcli.commands.chat.stdin_is_terminal", lambda: True)
    code, out, err = chat(stories, "Hello!\n")  # then end of input: Ctrl-D
    assert code == 0 and out.startswith("> ") and out.endswith("> \n") and len(requests) == 1
    assert err.startswith(f"chatting with {stories}: /reset starts over")


@pytest.mark.parametrize("template, fragment", [
    ("missing.jinja", "no such file"),
    ("{% for m in messages %}", "not a Jinja template (line 1:"),
])
def test_a_bad_chat_template_file_is_one_line(stories, tmp_path, template, fragment):
    path = tmp_path / template
    if template.startswith("{"):
        path = tmp_path / "bad.jinja"
        path.write_text(template)
    code, _, err = invoke("chat", "--model", stories, "--chat-template", path, input="Hello!\n")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --chat-template {path}: {fragment}")


def test_a_template_that_fails_on_a_message_names_chats_own_way_out(stories, tmp_path):
    """chat has no --raw: the hint is the template."""
    path = tmp_path / "raise.jinja"
    path.write_text('{{ raise_exception("no system messages") }}')
    code, _, err = invoke("chat", "--model", stories, "--chat-template", path, input="Hello!\n")
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1] == (f"error: the chat template {path} failed: no system messages (fix the "
                                       "template, or give another with --chat-template FILE)"), err


def test_a_template_that_renders_earlier_turns_differently_is_encoded_whole(stories):
    from pagedcli.commands.chat import Conversation
    from pagedcli.model.tokenizer import Tokenizer

    tok = Tokenizer(stories)
    tok.chat_template = "{{ bos_token }}{{ messages | length }} {% for m in messages %}{{ m.content }}|{% endfor %}"
    talk = Conversation(tok)
    turn = talk.prompt("Hi")
    talk.add(turn, [400, 401], "ab")
    turn = talk.prompt("Again")
    assert not turn.extended and turn.ids == tok.encode_rendered("<s>3 Hi|ab|Again|")


def test_a_template_that_trims_the_answer_still_extends_the_conversation(stories):
    from pagedcli.commands.chat import Conversation
    from pagedcli.model.tokenizer import Tokenizer

    tok = Tokenizer(stories)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}{{ eos_token }}{% endfor %}"
    tok.chat_template += "{% if add_generation_prompt %}assistant: {% endif %}"
    talk = Conversation(tok, system="Be brief.")
    turn = talk.prompt("Hi")
    assert turn.ids == tok.encode_rendered("system: Be brief.</s>user: Hi</s>assistant: ")
    talk.add(turn, [400, 401], " ab ")
    turn = talk.prompt("Again")
    assert turn.extended and turn.ids == talk.ids + tok.encode_rendered("</s>user: Again</s>assistant: ")
    assert talk.ids[-2:] == [400, 401]


def test_the_llama3_template_extends_turn_by_turn(llama3_tokenizer):
    """Llama 3's own template (it trims each message): the new turn's ids are the old ones, the
    answer's and then only what the new text adds, and here equal the whole rendering encoded."""
    from pagedcli.commands.chat import Conversation
    from pagedcli.model.tokenizer import Tokenizer

    tok = Tokenizer(llama3_tokenizer)
    talk = Conversation(tok, system="Be brief.")
    turn = talk.prompt("What is 2+2?")
    talk.add(turn, tok.encode_rendered("The answer is 4."), "The answer is 4.")
    turn = talk.prompt("And 3+3?")
    assert turn.extended and turn.ids[:len(talk.ids)] == talk.ids and turn.ids == tok.encode_rendered(turn.text)
    assert tok.decode(turn.ids[len(talk.ids):], skip_special_tokens=False) == (
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


# --- generate: prompts from standard input -----------------------------------------------------------
def generate_json(stories, *args, input=""):
    code, out, err = invoke("generate", "--model", stories, "--raw", "--max-tokens", "2", "--json", *args, input=input)
    assert code == 0, err
    return [json.loads(line)["prompt"] for line in out.splitlines()]


@pytest.mark.parametrize("args", [["-"], ["--prompt-file", "-"], []])
def test_generate_reads_prompts_from_standard_input(stories, args):
    assert generate_json(stories, *args, input="\ufeffOnce upon a time\r\n\nThe dog\n") == ["Once upon a time", "The dog"]


def test_a_dash_argument_reads_standard_input_in_its_place(stories):
    assert generate_json(stories, "First", "-", "Last", input="Two\nThree\n") == ["First", "Two", "Three", "Last"]


@pytest.mark.parametrize("separator, prompts", [
    (r"\n\n", ["Once upon\na time", "The dog|\nran"]),
    ("", ["Once upon\na time\n\n\nThe dog|\nran"]),
    ("|", ["Once upon\na time\n\n\nThe dog", "ran"]),
])
def test_a_prompt_separator_allows_prompts_of_several_lines(stories, separator, prompts):
    text = "Once upon\na time\n\n\nThe dog|\nran\n"
    assert generate_json(stories, "--prompt-separator", separator, "-", input=text) == prompts


def test_no_prompt_with_a_terminal_for_stdin_is_the_usual_error(stories, monkeypatch):
    monkeypatch.setattr("pagedcli.console.prompts.stdin_is_terminal", lambda: True)
    code, out, err = invoke("generate", "--model", stories, input="never read\n")
    assert code == 2 and out == "" and err.strip().startswith("error: no prompt given (pass one")


@pytest.mark.parametrize("args, input, fragment", [
    ([], "", "no prompt given, and standard input is empty"),
    (["-", "--prompt-file", "-"], "x\n", "standard input (`-`) is named twice"),
    (["--prompt-separator", r"\q", "-"], "x\n", r"--prompt-separator '\\q': unknown escape \q"),
    (["-"], b"caf\xe9\n", "-: standard input: not UTF-8 text (byte 3)"),
    (["--prompt-file", "-"], " \n\n", "--prompt-file -: has no prompts (standard input is empty)"),
    (["x", "-"], "\n", "-: standard input has no prompts"),
    (["--system", "Be kind.", "--raw", "x"], "", "--system goes in the chat template, which --raw leaves out"),
])
def test_bad_standard_input_is_one_line(stories, args, input, fragment):
    code, out, err = invoke("generate", "--model", stories, *args, input=input)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: " + fragment), err


def test_generate_takes_a_system_message_and_a_chat_template_file(stories):
    from pagedcli.model.tokenizer import Tokenizer

    code, out, err = invoke("generate", "--model", stories, "--chat-template", TEMPLATE, "--system", "Be kind.",
                            "--max-tokens", "2", "--json", "Hello!")
    assert code == 0, err
    assert json.loads(out)["prompt_token_ids"] == Tokenizer(stories).encode_rendered(
        "<s>[system]\nBe kind.</s>\n[user]\nHello!</s>\n[assistant]\n")


def test_a_stop_string_ends_the_answer_the_next_turn_builds_on(stories, requests):
    """--stop in a conversation: the answer shown ends before the stop string, and the next turn's
    prompt continues from that text, not from the tokens that completed the stop string."""
    from pagedcli.model.tokenizer import Tokenizer

    code, out, err = chat(stories, "Hello\nAnd then?\n", "--max-tokens", "30", "--stop", "Ann")
    assert code == 0, err
    first, second = requests
    assert first.finish_reason == "stop" and "Ann" not in out
    tok = Tokenizer(stories)
    shown = out.splitlines()[0]
    assert shown.strip() and tok.decode(first.output_token_ids).startswith(shown + "Ann")
    assert "Ann" not in tok.decode(second.prompt_token_ids)
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert tok.encode_rendered(shown) == second.prompt_token_ids[len(first.prompt_token_ids):][:len(tok.encode_rendered(shown))]
