"""Tool calls: the two forms a model writes them in (Hermes / Qwen's tags, Llama 3's JSON) parsed
into OpenAI's tool_calls, and the grammar that holds an answer to one call (tool_choice "required"
or a named function), run through the engine with the built-in model, whose free text is
Shakespeare: every held answer parses as a call of one of the tools."""

from __future__ import annotations

import json

import pytest

from pagedcli.core.options import SamplingParams
from pagedcli.serve import tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string", "maxLength": 12}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona"}}\n</tool_call>', None,
     [("get_weather", {"city": "Verona"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Mantua\\"}"}</tool_call>', "Let me look.",
     [("get_time", {}), ("get_weather", {"city": "Mantua"})]),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, None),  # not a tool: text
    ("O Romeo, Romeo!", None, None),
])
def test_hermes_calls_parse(text, content, calls):
    got_content, got = tools.parse(text, "hermes", NAMES)
    if calls is None:
        assert got == [] and got_content == text
        return
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Verona"}}', [("get_weather", {"city": "Verona"})]),
    ('<|python_tag|>{"name": "get_time", "arguments": {}}; {"name": "get_weather", "parameters": {"city": "a;b"}}',
     [("get_time", {}), ("get_weather", {"city": "a;b"})]),
    ('{"name": "get_weather", "parameters": {"city": "Verona"}} and more', None),
    ('{"nam": "get_weather"}', None),
])
def test_llama3_json_calls_parse(text, calls):
    content, got = tools.parse(text, "llama3_json", NAMES)
    if calls is None:
        assert got == [] and content == text
    else:
        assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_parser_follows_the_template():
    assert tools.parser_for("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tools.parser_for("{{- '<|python_tag|>' }}") == "llama3_json"


@pytest.mark.parametrize("parser", tools.PARSERS)
@pytest.mark.parametrize("choice", [[WEATHER, CLOCK], [WEATHER]], ids=["required", "named"])
def test_a_held_answer_is_always_a_call(demo_engine, parser, choice):
    loaded = demo_engine
    kind, text = tools.constraint(choice, parser)
    seqs = [loaded.engine.add_request(loaded.tokenizer.encode("ROMEO: what says the sky?"),
                                      SamplingParams(max_tokens=90, temperature=t, seed=s, structured=(kind, text)))
            for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    while loaded.engine.has_unfinished:
        loaded.engine.step()
    for seq in seqs:
        answer = loaded.tokenizer.decode(seq.output_token_ids)
        _, calls = tools.parse(answer, parser, {c["function"]["name"] for c in choice})
        assert seq.finish_reason == "stop" and len(calls) == 1, answer
        if len(choice) == 1:
            assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}


@pytest.fixture(scope="module")
def demo_engine():
    from pagedcli.core.options import EngineOptions
    from pagedcli.engine.build import load

    return load(EngineOptions(model="demo", device="cpu", batch=3))


def test_template_messages_give_the_template_objects():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = tools.template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Verona"}
    assert out[1] == messages[1] and messages[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Verona"}'
