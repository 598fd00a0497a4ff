"""What agents and eval harnesses send pagedcli serve, through the official `openai` client against
a server on a free loopback port with the built-in model (whose free text is Shakespeare, never
JSON): response_format json_schema / json_object and vLLM's structured-output fields always give an
answer that parses and validates (greedy, sampled, n = 4, streamed or not); parse() returns the
object; tool calls (tool_choice required and named) come back as tool_calls, streamed as OpenAI
streams them (the call's name first, then its arguments in pieces), and the next turn takes the
call and its result; echo with max_tokens 0 gives the prompt's log-probabilities, equal to
transformers' log-softmax, a long prompt's too (a message from the engine larger than a read of its
pipe); fields the server does not do are a 400, not ignored; lm-evaluation-harness's
local-completions runs tools/lm_eval_check.py's tasks (where lm-eval is installed). The chat
template (tests/assets/chat/tools_template.jinja) has Hermes's shape: its tool calls are
<tool_call> tags."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from serve_fixtures import served
from test_structured import SCHEMA, valid
from conftest import ASSETS

pydantic = pytest.importorskip("pydantic")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "ROMEO: what says the sky over Verona?"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server():
    with served(batch=4, template=ASSETS / "chat" / "tools_template.jinja") as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5, n=4)], ids=["greedy", "n4"])
def test_a_json_schema_response_always_parses_and_validates(server, stream, sampling):
    client = server.client()
    out = client.chat.completions.create(model="demo", messages=MESSAGES, response_format=FORMAT, max_tokens=160,
                                         stream=stream, **sampling)
    texts = {}
    if stream:
        for chunk in out:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    else:
        texts = {c.index: c.message.content for c in out.choices}
        assert all(c.finish_reason == "stop" for c in out.choices)
    assert len(texts) == sampling.get("n", 1) and all(valid(t) for t in texts.values()), texts
    server.settle()


def test_parse_returns_the_object(server):
    class Line(pydantic.BaseModel):
        speaker: str = pydantic.Field(max_length=12)
        act: int = pydantic.Field(ge=1, le=5)

    result = server.client().beta.chat.completions.parse(model="demo", messages=MESSAGES, response_format=Line,
                                                         max_tokens=60, temperature=0.7, seed=2)
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Line) and 1 <= parsed.act <= 5


@pytest.mark.parametrize("extra, pattern", [
    ({"response_format": {"type": "json_object"}}, None),
    ({"guided_choice": ["Montague", "Capulet"]}, {"Montague", "Capulet"}),
    ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, None),
])
def test_completions_take_vllms_structured_fields(server, extra, pattern):
    out = server.client().completions.create(model="demo", prompt="ROMEO:", max_tokens=60, temperature=0,
                                             extra_body=extra)
    text = out.choices[0].text
    if "response_format" in extra:
        assert isinstance(json.loads(text), dict)
    elif pattern is not None:
        assert text in pattern
    else:
        assert text[0].isupper() and text[1:].islower() and 3 <= len(text) <= 9


def test_a_format_that_does_not_compile_is_a_400(server):
    import openai

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="demo", messages=MESSAGES, response_format=bad, max_tokens=5)
    assert "does not compile" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="demo", messages=MESSAGES, response_format=FORMAT, max_tokens=5,
                                                extra_body={"guided_regex": "a"})
    assert "more than one format" in e.value.body["message"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_tool_calls_come_back_as_tool_calls_and_the_next_turn_takes_them(server, tool_choice):
    client = server.client()
    out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                         tool_choice=tool_choice, max_tokens=80, temperature=0.8, seed=3)
    calls, finish = out.choices[0].message.tool_calls, out.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1 and out.choices[0].message.content is None
    call = calls[0]
    assert call.id and call.type == "function" and call.function.name in ("get_weather", "get_time")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    turn = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, and the lark sings"}]
    answer = client.chat.completions.create(model="demo", messages=turn, tools=[WEATHER, CLOCK], max_tokens=20,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    server.settle()


@pytest.mark.parametrize("tool_choice, seed", [("required", 3), ("required", 4), (NAMED, 3)],
                         ids=["required-3", "required-4", "named"])
def test_tool_calls_stream_as_openai_streams_them(server, tool_choice, seed):
    """A call's first chunk has its index, id, type, name and arguments "", the later ones its index
    and pieces of its arguments (more than one: they go out as they are written), finish_reason
    tool_calls on the last; joined, they are the calls of the same request not streamed (and every
    token's log-probability comes in one of the chunks)."""
    client = server.client()
    request = dict(model="demo", messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=80,
                   temperature=0.8, seed=seed, logprobs=True)
    answer = client.chat.completions.create(**request).choices[0]
    whole = answer.message.tool_calls
    calls, pieces, finish, content, logprobs = {}, 0, None, "", []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            logprobs += choice.logprobs.content if choice.logprobs else []
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
                    calls[d.index][2] += d.function.arguments
                    pieces += 1
    assert finish == "tool_calls" and content == "" and pieces > 1
    assert [(name, arguments) for _, name, arguments in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(isinstance(json.loads(arguments), dict) for _, _, arguments in calls.values())
    # (the tokens held back while they may begin a call have their log-probabilities in a later chunk)
    assert [e.token for e in logprobs] == [e.token for e in answer.logprobs.content]
    assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in answer.logprobs.content], abs=1e-3)
    server.settle()


def test_a_streamed_answer_with_tools_and_no_call_is_its_text(server):
    """tool_choice auto, and the model writes no call (the built-in model writes Shakespeare): the
    stream is its text as content, the same as the answer not streamed."""
    client = server.client()
    request = dict(model="demo", messages=MESSAGES, max_tokens=24, temperature=0, tools=[WEATHER])
    plain = client.chat.completions.create(**request).choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == plain and finish == "length"
    server.settle()


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(server):
    """lm-evaluation-harness's log-likelihood request: the prompt back, each token's log-probability
    (the first's null), equal to transformers' float32 log-softmax of the same prompt."""
    from transformers import AutoModelForCausalLM

    from pagedcli.model.tokenizer import Tokenizer

    demo = ASSETS.parents[1] / "pagedcli" / "data" / "demo"
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?"
    out = server.client().completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    ids = Tokenizer(demo).encode(prompt)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    hf = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
    server.settle()


@pytest.mark.parametrize("chat, body, param", [
    (False, {"prompt": "ROMEO:", "logit_bias": {"50": 5}}, "logit_bias"),
    (True, {"messages": MESSAGES, "logit_bias": {"50": -100}}, "logit_bias"),
    (False, {"prompt": "ROMEO:", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (True, {"messages": MESSAGES, "functions": [WEATHER["function"]]}, "functions"),
    (True, {"messages": MESSAGES, "function_call": "auto"}, "function_call"),
])
def test_what_is_not_done_is_refused_not_ignored(server, chat, body, param):
    """Fields that would change the answer, which this server does not do: a 400 naming the field,
    not an answer that silently differs from what was asked (docs/serve.md, "Refused")."""
    import httpx

    r = httpx.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                   json={"model": "demo", "max_tokens": 2} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"),  # (empty or null: nothing asked)
                    json={"model": "demo", "max_tokens": 2, param: {} if param == "logit_bias" else None}
                    | {k: v for k, v in body.items() if k in ("prompt", "messages")})
    assert ok.status_code == 200, ok.text


def test_a_long_prompts_logprobs_come_back(server):
    """lm-eval's request for a prompt near the model's length, with the top 5 at each token: a
    message from the engine larger than one read of the pipe. (It used to end the server: the
    message's read came short, and read as the engine's death.)"""
    ids = [5 + (i * 37) % 250 for i in range(500)]
    client = server.client()
    for _ in range(3):
        out = client.completions.create(model="demo", prompt=ids, max_tokens=1, echo=True, logprobs=5, temperature=0)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == 501 and lp.token_logprobs[0] is None and all(len(t) == 5 for t in lp.top_logprobs[1:])
    assert server.engine.alive
    server.settle()


def test_the_engines_messages_are_read_in_pieces():
    """MessageReader: a message framed as multiprocessing's Connection frames it (the long form too),
    written into a non-blocking pipe a few bytes at a time, comes out whole once its last byte is
    in, and None until then; the pipe's end is EOFError."""
    import os
    import pickle
    import struct

    from pagedcli.serve.engine_client import MessageReader

    read, write = os.pipe()
    reader = MessageReader(read)
    messages = [("step", list(range(3000)), "é" * 5000), ("beat",)]
    payloads = [pickle.dumps(m) for m in messages]
    data = struct.pack("!i", len(payloads[0])) + payloads[0] + struct.pack("!i", -1) + struct.pack("!Q", len(payloads[1])) \
        + payloads[1]
    ends = [4 + len(payloads[0]), len(data)]  # where each message's last byte is
    got = []
    for at in range(0, len(data), 4099):
        os.write(write, data[at:at + 4099])
        while (m := reader.next()) is not None:
            got.append(m)
        assert len(got) == sum(end <= at + 4099 for end in ends)
    assert got == messages and reader.next() is None
    os.close(write)
    with pytest.raises(EOFError):
        reader.next()
    os.close(read)


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (pip install lm-eval)")
def test_lm_evaluation_harness_runs_its_log_likelihood_tasks(server, tmp_path):
    """tools/lm_eval_check.py's tasks through lm-eval's local-completions, prompts as token ids in
    batches of 8: the multiple-choice task above chance, the server's own greedy continuations
    greedy to lm-eval (their tokens' logprobs against top_logprobs) and generated again, and every
    log-likelihood transformers' (float32) for the same tokens."""
    check = load_tool("lm_eval_check")
    demo = str(ASSETS.parents[1] / "pagedcli" / "data" / "demo")
    check.write_tasks(tmp_path, 8, server.url, "demo", demo)
    accuracy, scored, _ = check.evaluate(server.url, "demo", demo, tmp_path, True, 8)
    assert accuracy[check.TASK] > 1 / check.CHOICES and accuracy[check.GREEDY] == 1 and accuracy[check.GENERATE] == 1
    assert check.reference(demo, scored) < 1e-3
    server.settle()


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ASSETS.parents[1] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllms_prompt_logprobs_field_names_each_prompt_token(server):
    """vLLM's prompt_logprobs: null for the first token, then each prompt token with its own
    log-probability and rank, beside the N likeliest (ranked 1..N)."""
    from pagedcli.model.tokenizer import Tokenizer

    prompt = "ROMEO:\nBut soft"
    out = server.client().completions.create(model="demo", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    ids = Tokenizer(ASSETS.parents[1] / "pagedcli" / "data" / "demo").encode(prompt)
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and entry[str(token)]["rank"] >= 1
        top = sorted(v["rank"] for k, v in entry.items() if v["rank"] <= 2)
        assert top[:2] == [1, 2]
