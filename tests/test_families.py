"""Qwen2 / Qwen2.5, Qwen3 and Mistral (with and without a sliding window) against transformers' own
Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM: each family preset's head geometry cut to
2 layers and a small hidden size, greedy tokens identical and logits within fp32 rounding, with
blocks handed out shuffled, several prompts in one batch, chunked prefill and prefix-cache hits.
A sliding window of 8 with prompts and answers that cross it many times, at block sizes 8 and 16,
holds a bounded number of blocks and leaks none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import hf_checkpoint
from helpers import check_block_accounting, hf_greedy, hf_model, invoke, record_logits
from test_oracle import prompts
from test_presets import assert_same
from pagedcli.core.errors import RunError
from pagedcli.core.options import SamplingParams
from pagedcli.model.config import ModelConfig
from pagedcli.model.families import FAMILIES
from pagedcli.model.source import RANDOM_PRESETS
from pagedcli.model.tokenizer import Tokenizer

ASSETS = Path(__file__).parent / "assets"
DEMO = Path(__file__).resolve().parents[1] / "pagedcli" / "data" / "demo"

FAMILY_PRESETS = {"qwen2.5-0.5b": "qwen2", "qwen2.5-1.5b": "qwen2", "qwen2.5-7b": "qwen2", "qwen3-0.6b": "qwen3",
                  "qwen3-1.7b": "qwen3", "qwen3-4b": "qwen3", "qwen3-8b": "qwen3", "mistral-7b-v0.1": "mistral",
                  "mistral-7b-v0.3": "mistral"}
# The model cards' parameter counts, in billions as they print them (rounded or cut to their last
# digit): (all, without the embeddings); Mistral's cards give one figure, its total
CARDS = {"qwen2.5-0.5b": (0.49, 0.36), "qwen2.5-1.5b": (1.54, 1.31), "qwen2.5-7b": (7.61, 6.53),
         "qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95),
         "mistral-7b-v0.1": (7.24, None), "mistral-7b-v0.3": (7.24, None)}
SMALL = dict(intermediate_size=96, vocab_size=256, num_hidden_layers=2, max_position_embeddings=512)
STEPS = 14
WINDOW = 8


def family_checkpoint(folder, preset: str, **overrides):
    """A transformers checkpoint of the preset's family and head geometry (heads, kv heads,
    head_dim, RoPE theta, tie, biases, window), cut small."""
    c = ModelConfig.from_file(RANDOM_PRESETS[preset])
    window = c.sliding_window and WINDOW  # a window short enough for the prompts below to cross it
    cfg = dict(num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
               hidden_size=4 * c.num_heads, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
               rms_norm_eps=c.rms_norm_eps, sliding_window=window) | SMALL | overrides
    return hf_checkpoint(folder, model_type=FAMILY_PRESETS[preset], **cfg)


def run(loaded, prompt_list, steps=STEPS, params=None):
    """Greedy answers and each step's logits, all prompts in one engine, block accounting checked
    after every step; the most blocks (one layer) a slot held while it decoded (its prompt's blocks
    are all taken at its admission, as without a window)."""
    engine = loaded.engine
    logits = record_logits(engine)
    params = params or SamplingParams(max_tokens=steps, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompt_list]
    held = 0
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
        cache = engine.cache
        held = max([held] + [cache.num_blocks_of_slot[s.slot] - cache.num_slid[s.slot]
                             for s in engine.scheduler.running if s.output_token_ids])
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks, "a block leaked"
    return [(seq.output_token_ids, logits[seq.id]) for seq in seqs], held


def test_every_family_preset_is_shipped_at_its_public_size():
    for name, family in FAMILY_PRESETS.items():
        preset = json.loads(RANDOM_PRESETS[name].read_text())
        config = ModelConfig.from_dict(preset)
        assert config.architecture == FAMILIES[preset["architectures"][0]].architecture
        assert preset["model_type"] == family and preset["_comment"]
        total, non_embedding = CARDS[name]
        embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
        for ours, card in ((config.num_parameters, total), (config.num_parameters - embedding, non_embedding)):
            last_digit = 10.0 ** -len(str(card).split(".")[1]) if card is not None else None
            assert card is None or abs(ours / 1e9 - card) < last_digit, (name, ours, card)


@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_preset_geometry_equals_transformers(tmp_path, make_engine, name):
    folder = family_checkpoint(tmp_path, name)
    config = ModelConfig.from_file(folder / "config.json")
    preset = ModelConfig.from_file(RANDOM_PRESETS[name])
    assert (config.architecture, config.num_heads, config.num_kv_heads, config.head_dim, config.qkv_bias,
            config.o_bias, config.qk_norm) == (preset.architecture, preset.num_heads, preset.num_kv_heads,
                                               preset.head_dim, preset.qkv_bias, preset.o_bias, preset.qk_norm)
    prompt_list = prompts([1, 17, 40], SMALL["vocab_size"], seed=3)
    ref = hf_model(folder)
    expected = [hf_greedy(ref, p, STEPS) for p in prompt_list]
    # a whole batch with prefills in one step, and with chunks of 5 tokens beside the decoding rows
    for opts in (dict(batch=3, chunked_prefill=False), dict(batch=2, max_num_batched_tokens=5)):
        results, _ = run(make_engine(folder, num_blocks=200, **opts), prompt_list)
        for result, ref_result in zip(results, expected):
            assert_same(result, ref_result)


def test_qwen_families_differ_from_llama_where_they_say():
    """A broken reader that dropped Qwen2's q/k/v biases or Qwen3's head norms would give Llama's
    numbers: the families' own tensors change the logits."""
    qwen2 = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **_dims()})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias, qwen2.qk_norm) == (True, False, False, False)
    qwen3 = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **_dims()})
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert qwen3.num_parameters - ModelConfig.from_dict({"model_type": "llama", **_dims()}).num_parameters == 2 * 2 * 16
    mistral = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "sliding_window": 4096, **_dims()})
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias
    llama = ModelConfig.from_dict({"model_type": "llama", "sliding_window": 4096, **_dims()})
    assert llama.sliding_window is None  # Llama has no window, whatever the file holds


def _dims() -> dict:
    return dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16)


@pytest.mark.parametrize("architecture, extra, message", [
    ("GPT2LMHeadModel", {}, "GPT2LMHeadModel is not supported"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window true"),
    ("Qwen3ForCausalLM", {"use_sliding_window": True}, "use_sliding_window true"),
])
def test_an_architecture_or_setting_not_run_is_one_line_naming_the_supported(architecture, extra, message):
    with pytest.raises(RunError, match=message) as e:
        ModelConfig.from_dict({"architectures": [architecture], **_dims(), **extra})
    if "GPT2" in architecture:
        assert all(name in e.value.hint for name in FAMILIES)


@pytest.mark.parametrize("block_size", [8, 16])
def test_a_sliding_window_crossed_many_times_is_transformers_and_holds_few_blocks(tmp_path, make_engine, block_size):
    """Mistral with a window of 8: prompts of 3 to 45 tokens and 30 new tokens each cross it many
    times; tokens and logits are transformers', with prefills whole and in chunks of 5 beside the
    decoding rows, and a prefix-cache hit (two prompts sharing 32 tokens). A decoding slot holds at
    most window / block_size + 1 blocks a layer: the blocks behind the window go back to the free
    list as the answer grows."""
    folder = family_checkpoint(tmp_path, "mistral-7b-v0.1")
    shared = prompts([32], SMALL["vocab_size"], seed=9)[0]
    prompt_list = prompts([3, 45], SMALL["vocab_size"], seed=5) + [shared + [7, 8], shared + [9]]
    ref = hf_model(folder)
    expected = [hf_greedy(ref, p, 30) for p in prompt_list]
    for opts in (dict(batch=4, chunked_prefill=False), dict(batch=2, max_num_batched_tokens=5)):
        loaded = make_engine(folder, num_blocks=400, block_size=block_size, **opts)
        results, held = run(loaded, prompt_list, steps=30)
        for result, ref_result in zip(results, expected):
            assert_same(result, ref_result)
        bound = -(-WINDOW // block_size) + 1
        assert held <= bound, f"a slot held {held} blocks a layer, past the window's {bound}"
        assert loaded.engine.cache.num_window_freed > 0
    without = ModelConfig.from_file(folder / "config.json")
    assert without.sliding_window == WINDOW


def test_a_window_is_what_changes_the_answer(tmp_path, make_engine):
    """The same weights without the window give other tokens past it: the window test above can fail."""
    folder = family_checkpoint(tmp_path, "mistral-7b-v0.1")
    prompt_list = prompts([30], SMALL["vocab_size"], seed=5)
    windowed, _ = run(make_engine(folder, num_blocks=200), prompt_list, steps=20)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window": None}))
    full, _ = run(make_engine(folder, num_blocks=200), prompt_list, steps=20)
    assert windowed[0][0] != full[0][0]


def test_a_long_windowed_generation_holds_a_bounded_pool(tmp_path, make_engine):
    """600 new tokens with a window of 8 in a pool of 40 blocks (2 layers): without giving blocks
    back it would need 2 x 38 blocks and stop at the pool's end; with the window it runs to its
    length, and parallel samples (copy-on-write of the prompt's blocks) slide as well."""
    folder = family_checkpoint(tmp_path, "mistral-7b-v0.1", max_position_embeddings=1024)
    loaded = make_engine(folder, num_blocks=40, batch=2, max_model_len=700)
    engine = loaded.engine
    seqs = engine.add_parallel(prompts([20], SMALL["vocab_size"], seed=1)[0],
                               [SamplingParams(max_tokens=600, ignore_eos=True, temperature=1.0, seed=s) for s in (1, 2)])
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert [len(s.output_token_ids) for s in seqs] == [600, 600] and all(s.finish_reason == "length" for s in seqs)
    assert engine.cache.num_free_blocks == 40


# --- chat templates ------------------------------------------------------------------------------
QWEN3_TEMPLATE = ASSETS / "chat" / "qwen3.jinja"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHi!"}, {"role": "user", "content": "Again"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather <today> & 'now'",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def qwen3_folder(folder):
    """A tiny Qwen3 checkpoint with the demo model's tokenizer (2,048 tokens) and Qwen3's own chat
    template (tests/assets/chat/qwen3.jinja)."""
    family_checkpoint(folder, "qwen3-0.6b", vocab_size=2048)
    shutil.copy(DEMO / "tokenizer.json", folder)
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN3_TEMPLATE.read_text()}))
    return folder


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
def test_qwen3s_template_renders_as_transformers_renders_it(tmp_path, variables):
    """ChatML turns, an earlier answer's thinking cut out, `enable_thinking` false closing an empty
    <think> block, tools as JSON the way transformers writes them (not Jinja's HTML-safe tojson)."""
    from transformers import AutoTokenizer

    folder = qwen3_folder(tmp_path)
    ours = Tokenizer(folder).render_chat(MESSAGES, variables=variables)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, tokenize=False,
                                                                       add_generation_prompt=True, **variables)
    assert ours == theirs
    assert ("<think>\n\n</think>" in ours) == (variables.get("enable_thinking") is False)


def test_generate_answers_a_qwen3_folder_through_its_template(tmp_path):
    """`pagedcli generate --model <a Qwen3 folder> Hello` feeds the ChatML-rendered prompt and
    answers transformers' greedy tokens; --chat-template-kwargs reaches the template."""
    folder = qwen3_folder(tmp_path)
    tokenizer = Tokenizer(folder)
    ref = hf_model(folder)
    for kwargs, think in ((None, False), ('{"enable_thinking": false}', True)):
        code, out, err = invoke("generate", "--model", str(folder), "--json", "--max-tokens", "6", "--temperature", "0",
                                "--ignore-eos", "Hello", *(["--chat-template-kwargs", kwargs] if kwargs else []))
        assert code == 0, err
        record = json.loads(out.splitlines()[-1])
        rendered = tokenizer.render_chat([{"role": "user", "content": "Hello"}],
                                         variables={"enable_thinking": False} if think else None)
        assert rendered.startswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
        assert record["prompt_token_ids"] == tokenizer.encode_rendered(rendered)
        assert record["token_ids"] == hf_greedy(ref, record["prompt_token_ids"], 6)[0]
    code, _, err = invoke("generate", "--model", str(folder), "--chat-template-kwargs", "[1]", "Hello")
    assert code == 2 and "--chat-template-kwargs '[1]' is not a JSON object" in err


def test_a_chat_request_passes_its_chat_template_kwargs(tmp_path):
    """serve's /v1/chat/completions: vLLM's `chat_template_kwargs` field reaches the template."""
    from pagedcli.serve.protocol import ChatRequest
    from pagedcli.serve.sampling import chat_prompt

    tokenizer = Tokenizer(qwen3_folder(tmp_path))
    body = {"messages": [{"role": "user", "content": "Hello"}]}
    plain, _ = chat_prompt(ChatRequest.model_validate(body), tokenizer, "qwen3")
    off, _ = chat_prompt(ChatRequest.model_validate(body | {"chat_template_kwargs": {"enable_thinking": False}}),
                         tokenizer, "qwen3")
    assert off[0][:len(plain[0])] == plain[0] and tokenizer.decode(off[0][len(plain[0]):]) == "<think>\n\n</think>\n\n"


# --- a sliding window, shown -------------------------------------------------------------------------
def mistral_folder(folder):
    """A tiny Mistral checkpoint with a window of 8 and the demo model's tokenizer."""
    family_checkpoint(folder, "mistral-7b-v0.1", vocab_size=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, folder)
    return folder


def test_inspect_cache_shows_the_blocks_given_back_behind_the_window(tmp_path):
    """inspect-cache --json: the blocks behind the window have no physical block and no bytes, the
    rest their addresses; the text table says the same in words."""
    folder = mistral_folder(tmp_path)
    args = ("--model", str(folder), "--raw", "--temperature", "0", "--max-tokens", "40", "--ignore-eos",
            "--block-size", "8", "--slot", "0", "ROMEO: what light")
    code, out, err = invoke("inspect-cache", *args, "--json")
    assert code == 0, err
    snap = json.loads(out)
    blocks = snap["layers"][1]["blocks"]
    released = [b for b in blocks if b["released"]]
    assert snap["sliding_window"] == WINDOW and len(released) == snap["released_blocks"] > 0
    assert blocks[:len(released)] == released  # the oldest ones, at the start
    assert all(b["physical"] is None and b["k_offset"] is None for b in released)
    assert all(isinstance(b["physical"], int) and b["k_offset"] == b["physical"] * snap["geometry"]["block_bytes"]
               for b in blocks[len(released):])
    assert len(blocks) - len(released) <= WINDOW // 8 + 1
    code, out, err = invoke("inspect-cache", *args)
    assert code == 0 and "sliding window of 8 tokens" in out
    assert out.count("given back │") == len(released)
    assert f"(layer 1: {len(released)} given back, then" in " ".join(out.split())  # (the note wraps)


def test_the_live_view_draws_the_blocks_given_back_and_counts_them(tmp_path, make_engine):
    from rich.console import Console

    from pagedcli.console.drawing import render

    loaded = make_engine(mistral_folder(tmp_path), block_size=8, num_blocks=200)
    engine = loaded.engine
    engine.add_request(prompts([30], 2048, seed=2)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(10):
        engine.step()
    snap = engine.snapshot()
    slot = snap.slots[0]
    assert slot.num_released == (slot.num_cached - WINDOW + 1) // 8 and slot.num_held <= WINDOW // 8 + 1
    console = Console(width=120, record=True, color_system=None)
    console.print(render(snap, width=120))
    frame = console.export_text()
    assert "×" * slot.num_released in frame
    assert f"sliding window of 8 tokens: {snap.num_window_freed} blocks given back behind it" in frame
    assert f"{slot.num_held} x 2 = {2 * slot.num_held}" in frame  # the blocks held, not the logical ones


def test_a_window_under_a_tight_pool_preempts_and_answers_as_alone(tmp_path, make_engine):
    """Four windowed sequences in a pool of 10 blocks (2 layers: 5 a layer, where two decoding
    sequences hold up to 3 each): admissions wait and running sequences are preempted and
    recomputed, with blocks given back behind each window on the way; every answer equals its own
    run alone, and no block leaks."""
    folder = family_checkpoint(tmp_path, "mistral-7b-v0.1")
    prompt_list = prompts([20, 30, 9, 25], SMALL["vocab_size"], seed=12)
    alone = [run(make_engine(folder, num_blocks=200, block_size=8), [p], steps=40)[0][0][0] for p in prompt_list]
    loaded = make_engine(folder, num_blocks=10, block_size=8, batch=4, max_num_batched_tokens=16)
    together, _ = run(loaded, prompt_list, steps=40)
    assert [tokens for tokens, _ in together] == alone
    assert loaded.engine.scheduler.num_preemptions > 0
