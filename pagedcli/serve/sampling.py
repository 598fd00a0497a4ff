"""A request's prompt and options, turned into what the engine takes: the prompts' token ids and
one SamplingParams per answer, or a 400 naming the field.

Each option the request leaves out takes the server's default: its flags, else the model's
generation_config.json (as `pagedcli generate` does). A request is refused up front when it could
never run (an empty prompt, one longer than the model's length or the pool, token ids outside the
vocabulary) or when `max_tokens` asks for more than the model's length leaves after the prompt
(vLLM's check); without `max_tokens` an answer may run to that length."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pagedcli.core.errors import PagedCliError, plural
from pagedcli.core.options import MAX_N, SamplingParams
from pagedcli.engine.scheduler import PromptLimits
from pagedcli.model.tokenizer import Tokenizer
from pagedcli.serve import tools
from pagedcli.serve.errors import bad_request
from pagedcli.serve.protocol import SAMPLING_FIELDS, ChatRequest, CompletionRequest, Sampling


@dataclass
class Prompts:
    """What the engine runs for one request: each prompt's token ids (and text, for the live
    view and the cache view) and its answers' params, `n` per prompt."""

    token_ids: list[list[int]]
    texts: list[str | None]
    params: list[list[SamplingParams]]

    @property
    def num_answers(self) -> int:
        return sum(len(p) for p in self.params)


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer,
                       max_chars: int | None = None) -> tuple[list[list[int]], list[str | None]]:
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"`best_of` {req.best_of}: not supported here (answers are not ranked); use `n`", "best_of")
    if req.suffix:
        raise bad_request("`suffix` (text after the insertion) is not supported here", "suffix")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("`prompt` is an empty list", "prompt")
    if isinstance(prompt[0], int):  # one prompt of token ids
        return [list(prompt)], [None]
    if isinstance(prompt[0], list):
        return [list(p) for p in prompt], [None] * len(prompt)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: give `prompt` as token ids", "prompt")
    for i, text in enumerate(prompt):
        check_length(text, max_chars, f"prompt[{i}]" if len(prompt) > 1 else "prompt")
    return [tokenizer.encode(p) for p in prompt], list(prompt)


def chat_prompt(req: ChatRequest, tokenizer: Tokenizer, model_name: str,
                max_chars: int | None = None) -> tuple[list[list[int]], list[str | None]]:
    if tokenizer is None:
        raise bad_request(f"model {model_name} has no tokenizer, so it serves /v1/completions of token ids only",
                          "messages")
    if not tokenizer.has_chat_template:
        raise bad_request(f"model {model_name} has no chat template, so it serves /v1/completions only "
                          "(or start the server with --chat-template FILE)", "messages")
    if not req.messages:
        raise bad_request("`messages` is empty", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content if m.content is not None else ""
        if not isinstance(content, str):
            other = next((p.type for p in content if p.type != "text"), None)
            if other is not None:
                raise bad_request(f"`messages[{i}].content`: a part of type {other!r}; this server takes text only",
                                  f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        message |= {k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id), ("name", m.name))
                    if v is not None}
        messages.append(message)
    variables = dict(req.chat_template_kwargs or {})
    if req.tools and req.tool_choice != "none":  # as transformers passes `tools=` to the template
        variables["tools"] = tools.template_tools([t.model_dump() for t in req.tools])
    try:
        text = tokenizer.render_chat(tools.template_messages(messages), variables=variables)
    except PagedCliError as e:  # (its hint is generate's: a client's way out is another)
        raise bad_request(f"{e.message} (change the messages, or send the prompt as text to /v1/completions)",
                          "messages") from None
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
    check_length(text, max_chars, "messages")
    return [tokenizer.encode_rendered(text)], [last]


def longest_text(tokenizer: Tokenizer, max_model_len: int) -> int | None:
    """The most characters a prompt's text may have and still be `max_model_len` tokens or fewer:
    no token stands for more characters of the text than its piece has (a byte-level piece has a
    character a byte, SentencePiece's `▁` stands for one space, a byte-fallback piece `<0xE3>` for
    one byte), so a longer text cannot fit, and is refused before it is tokenized (which takes some
    hundred times the text's memory).
    None where the tokenizer's normalizer may shorten a text (NFKC, lowercasing, stripping): no
    such bound holds there."""
    import json

    normalizer = tokenizer.tok.normalizer
    if normalizer is not None and not _only_lengthens(json.loads(normalizer.__getstate__())):
        return None
    longest = max(map(len, tokenizer.tok.get_vocab(with_added_tokens=True)), default=1)
    return max_model_len * max(longest, 1)


def _only_lengthens(normalizer: dict) -> bool:
    """Whether this normalizer (its JSON) only lengthens a text: SentencePiece's Prepend("▁") and
    Replace(" ", "▁"), alone or in a Sequence."""
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_only_lengthens(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode())
    return False


def check_length(text: str, max_chars: int | None, where: str) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise bad_request(f"`{where}`: {len(text):,} characters, more than any text of the model's maximum length "
                          f"can hold (at most {max_chars:,} characters, however it tokenizes)", where,
                          "context_length_exceeded")


def check_answer_count(data: dict, room: tuple[int, int]) -> None:
    """The count of answers a completion request's body asks for, checked before its prompts are
    validated and tokenized (two million prompts took a minute to be refused)."""
    prompt, n = data.get("prompt"), data.get("n")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N:
        refuse_past_room(num_prompts, n, room)
    elif num_prompts > sum(room):
        refuse_past_room(num_prompts, 1, room)


def refuse_past_room(num_prompts: int, n: int, room: tuple[int, int] | None) -> None:
    """A 400 for a request with more answers than the server runs and lets wait at once."""
    num_answers = num_prompts * n
    if room is not None and num_answers > sum(room):
        raise bad_request(f"the request asks for {num_answers:,} answers ({plural(num_prompts, 'prompt')} times "
                          f"`n` {n}), more than this server runs and lets wait at once ({sum(room):,}: "
                          f"{room[0]} slots and its --max-waiting {room[1]})", "n" if num_prompts == 1 else "prompt")


def request_params(req: Sampling, defaults: SamplingParams, limits: PromptLimits, token_ids: list[list[int]],
                   has_tokenizer: bool = True, room: tuple[int, int] | None = None,
                   tool_parser: str = "hermes") -> list[list[SamplingParams]]:
    """The answers' params for each prompt, `n` each: the i-th answer of the request samples
    with seed + i, as generate's answers do, so that it does not depend on its batch mates.
    `room`: the server's slots and --max-waiting; a request with more answers than both hold is
    refused (it would queue past --max-waiting)."""
    given = {f: getattr(req, f) for f in SAMPLING_FIELDS if getattr(req, f) is not None}
    refuse_what_is_not_done(req)
    if req.stream_options is not None and not req.stream:  # (vLLM's 400 too: it would be silently ignored)
        raise bad_request("`stream_options` is for a streamed answer: send `stream: true` too, or leave it out",
                          "stream_options")
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            given["max_tokens"] = req.max_completion_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs` true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        logprobs, logprobs_field = req.logprobs, "logprobs"
    if req.stop is not None:
        given["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    given["structured"] = structured(req, tool_parser)
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo:
        if logprobs is not None:  # OpenAI's echo with logprobs: the prompt tokens' come first
            prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
        if given.get("max_tokens") == 0:  # the prompt alone: one token is computed, and not returned
            given["max_tokens"] = 1
    if prompt_logprobs is not None:
        given["prompt_logprobs"] = prompt_logprobs
    base = replace(defaults, **given, logprobs=logprobs)
    if base.stop and not has_tokenizer:
        raise bad_request("`stop` needs the text, and this model has no tokenizer", "stop")
    problem = base.problem()
    if problem is not None:
        name, value, why, hint = problem
        name = logprobs_field if name == "logprobs" else name
        raise bad_request(f"`{name}` {value}: {why}" + (f" ({hint})" if hint else ""), name)
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"`n` {req.n}: must be from 1 to {MAX_N}", "n")
    refuse_past_room(len(token_ids), req.n, room)
    limit = limits.max_model_len
    prompt_field = "messages" if isinstance(req, ChatRequest) else "prompt"
    params = []
    for i, ids in enumerate(token_ids):
        where = f"{prompt_field}[{i}]" if len(token_ids) > 1 else prompt_field  # which of several prompts
        if problem := limits.why_unrunnable(len(ids)):
            raise bad_request(f"`{where}`: {problem}", where, "context_length_exceeded" if ids else None)
        if problem := limits.unknown_token(ids):
            raise bad_request(f"`{where}`: {problem}", where)
        room = limit - len(ids)
        if "max_tokens" in given and base.max_tokens > room:
            raise bad_request(f"`max_tokens` {base.max_tokens}: the model's maximum length is {plural(limit, 'token')}, "
                              f"and the prompt has {plural(len(ids), 'token')}, so at most {room:,} new ones fit",
                              "max_tokens", "context_length_exceeded")
        p = base if base.max_tokens <= room else replace(base, max_tokens=room)
        seeds = [None if p.seed is None else p.seed + len(params) * req.n + j for j in range(req.n)]
        params.append([replace(p, seed=s) for s in seeds])
    return params


def refuse_what_is_not_done(req: Sampling) -> None:
    """A 400 for a field this server reads but does not do, where ignoring it would hand the client
    something else than it asked for (docs/serve.md, "Refused")."""
    if req.logit_bias:
        raise bad_request("`logit_bias` is not supported here (the logits are not biased); leave it out", "logit_bias")
    if req.prompt_logprobs is not None and req.stream:  # (vLLM's 400 too)
        raise bad_request("`prompt_logprobs` are not sent in a streamed answer: leave out `stream`, or them "
                          "(completions' `echo` with `logprobs` streams the prompt's log-probabilities)", "prompt_logprobs")
    if isinstance(req, ChatRequest) and (req.functions or req.function_call is not None):
        raise bad_request("`functions` and `function_call` (OpenAI's deprecated form of tools) are not supported here: "
                          "give `tools` and `tool_choice`", "functions" if req.functions else "function_call")


def structured(req: Sampling, tool_parser: str) -> tuple[str, str] | None:
    """The format the request holds its answer to, as SamplingParams.structured: OpenAI's
    response_format, vLLM's structured_outputs or guided_* fields, or a tool call that must come
    (tool_choice "required" or a named function); at most one of them."""
    asked = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", ("json_object", "")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("`response_format` json_schema needs `json_schema.schema`", "response_format")
        asked.append(("response_format", ("json", json.dumps(rf.json_schema.schema_))))
    so = req.structured_outputs
    for field, kind, value in (
            ("structured_outputs", "json", so.json_ if so else None), ("structured_outputs", "regex", so.regex if so else None),
            ("structured_outputs", "choice", so.choice if so else None),
            ("structured_outputs", "grammar", so.grammar if so else None),
            ("structured_outputs", "json_object", "" if so and so.json_object else None),
            ("guided_json", "json", req.guided_json), ("guided_regex", "regex", req.guided_regex),
            ("guided_choice", "choice", req.guided_choice), ("guided_grammar", "grammar", req.guided_grammar)):
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            asked.append((field, (kind, text)))
    if isinstance(req, ChatRequest) and req.tools and req.tool_choice not in (None, "auto", "none"):
        chosen = [t.model_dump() for t in req.tools]
        if not isinstance(req.tool_choice, str):  # a named function
            name = req.tool_choice.function.get("name")
            chosen = [t for t in chosen if t["function"]["name"] == name]
            if not chosen:
                raise bad_request(f"`tool_choice` names {name!r}, which is not one of `tools`", "tool_choice")
        asked.append(("tool_choice", tools.constraint(chosen, tool_parser)))
    if len(asked) > 1:
        names = sorted({field for field, _ in asked})
        raise bad_request(f"{' and '.join(f'`{n}`' for n in names)} ask for more than one format; give one", names[0])
    return asked[0][1] if asked else None
