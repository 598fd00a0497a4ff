"""What agents and eval harnesses send pagedcli serve, through the official `openai` client against
a server on a free loopback port with the built-in model (whose free text is Shakespeare, never
JSON): response_format json_schema / json_object and vLLM's structured-output fields always give an
answer that parses and validates (greedy, sampled, n = 4, streamed or not); parse() returns the
object; tool calls (tool_choice required and named) come back as tool_calls, streamed too, and the
next turn takes the call and its result; echo with max_tokens 0 gives the prompt's log-probabilities,
equal to transformers' log-softmax. The chat template (tests/assets/chat/tools_template.jinja) has
Hermes's shape: its tool calls are <tool_call> tags."""

from __future__ import annotations

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


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_come_back_as_tool_calls_and_the_next_turn_takes_them(server, stream, tool_choice):
    client = server.client()
    out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=[WEATHER, CLOCK],
                                         tool_choice=tool_choice, max_tokens=80, temperature=0.8, seed=3, stream=stream)
    if stream:
        calls, finish = [], None
        for chunk in out:
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
    else:
        calls, finish = out.choices[0].message.tool_calls, out.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1
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
