"""Tool calls: the two forms a model writes them in (Hermes / Qwen's tags, Llama 3's JSON) parsed
into OpenAI's tool_calls, whole and incrementally as a stream (tools.CallStream: the same calls
however the text is split into tokens, content before a call out before the call ends, arguments
out as they are written); and the grammar that holds an answer to one call (tool_choice "required"
or a named function), run through the engine with the built-in model, whose free text is
Shakespeare: every held answer parses as a call of one of the tools."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    ('<tool_call>\n{"arguments": {"city": "Verona"}, "name": "get_weather"}</tool_call>', None,  # name last
     [("get_weather", {"city": "Verona"})]),
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),  # no arguments: none
    ('<tool_call>{"name": "get_weather", "id": [1, {"a": "}"}], "arguments": {"city": "Pisa"}}</tool_call>', None,
     [("get_weather", {"city": "Pisa"})]),  # another key, skipped
    ("O Romeo, Romeo!", None, None),
    ("O <tool_ <tool_call>not json</tool_call> <tool", None, None),
    ("", None, None),
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
    ('  {"name": "get_weather", "parameters": "{\\"city\\": \\"Verona\\"}"}', [("get_weather", {"city": "Verona"})]),
    ('{"nam": "get_weather"}', None),
    ('{"name": "get_sky", "parameters": {}}', None),
    ("ROMEO: {", None),
    ("<|python_tag|>", None),
])
def test_llama3_json_calls_parse(text, calls):
    content, got = tools.parse(text, "llama3_json", NAMES)
    if calls is None:
        assert got == [] and content == text
    else:
        assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_text_after_a_call_is_content():
    """A call, once its name has gone out, stands (a stream cannot take it back): what follows it
    that is no call is content, and the whole answer reads the same."""
    content, got = tools.parse('{"name": "get_weather", "parameters": {"city": "Verona"}} and more', "llama3_json", NAMES)
    assert content == " and more" and [(c.name, c.arguments) for c in got] == [("get_weather", '{"city": "Verona"}')]
    content, got = tools.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nAnon.', "hermes", NAMES)
    assert content == "\nAnon." and [c.name for c in got] == ["get_time"]


# Answers as a tokenizer would cut them (hand-written pieces); each is also cut at every character
HERMES_TOKENS = [
    ["Let", " me", " look", ".", "\n", "<", "tool", "_call", ">\n", '{"', "name", '":', ' "', "get", "_weather", '",',
     ' "', "arguments", '":', ' {"', "city", '":', ' "', "Ver", "ona", '"}}', "\n", "</", "tool", "_call", ">", "\n",
     "<tool_call>", '{"name": "get_time", ', '"arguments": {', "}}", "</tool_call>"],
    ["<tool_call>", '{"name": "get_weather", "arguments": "{\\"city', '\\": \\"Man', 'tua\\"}"}', "</tool_call>"],
    ["O", " <", "tool", "_c", "all", "!", " <tool_call>", '{"name": "nobody"}', "</tool_call>", " fare", "well", "  "],
    ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "a\\"}b"}', ", \"x\": 1}", "</tool_call>"],
    ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Ver'],  # cut by max_tokens
    ["<tool_call>", '{"name": "get_wea'],  # cut before its name is known: text
]
LLAMA_TOKENS = [
    ["<|python_tag|>", '{"name": "get_time", "parameters": {}}', "; ", '{"name"', ': "get_weather", ', '"parameters": ',
     '{"city": "a;b"}}'],
    ["  ", "{", '"name": "get_weather", "parameters": {"city": "Verona", "days": [1, 2]}}'],
    ["<|python", "_tag|>", "O Romeo"],
    ["{", '"name": 3}'],
    ["JULIET", ":", " {"],
]


def streamed(pieces: list[str], parser: str) -> tuple[str | None, list[tuple[str, str]], list]:
    """The pieces fed one at a time: (content, [(name, arguments)], every event), checking the
    order OpenAI streams them in: a call's first event before its arguments, indices in order."""
    stream = tools.CallStream(parser, NAMES)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content, calls = "", []
    for e in events:
        if e[0] == "content":
            content += e[1]
        elif e[0] == "call":
            assert e[1] == len(calls) and e[2].id.startswith("call_")
            calls.append([e[2].name, ""])
        else:
            assert e[1] == len(calls) - 1  # (the pieces of the call that last began)
            calls[e[1]][1] += e[2]
    assert [(c.name, c.arguments) for c in stream.calls] == [tuple(c) for c in calls]
    return (content or None) if calls else content, [tuple(c) for c in calls], events


def cuts(text: str):
    """The text cut at every place, then at every character."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("parser, pieces", [("hermes", t) for t in HERMES_TOKENS] + [("llama3_json", t) for t in LLAMA_TOKENS])
def test_a_stream_reads_the_same_however_it_is_cut(parser, pieces):
    """The calls streamed (names, and arguments joined from their pieces) and the content are what
    the whole text parses to, for the tokens as written and for the text cut at every place; a
    call that ended has arguments that parse as JSON."""
    text = "".join(pieces)
    whole = streamed([text], parser)[:2]
    assert streamed(pieces, parser)[:2] == whole
    for cut in cuts(text):
        assert streamed(cut, parser)[:2] == whole, cut
    for _, arguments in whole[1][:-1]:
        json.loads(arguments)
    content, calls = tools.parse(text, parser, NAMES)
    assert (content, [(c.name, c.arguments) for c in calls]) == as_parsed(text, whole)


def is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def as_parsed(text: str, whole: tuple) -> tuple:
    """What tools.parse makes of an answer the stream read as `whole` (content, [(name, arguments)]):
    the same, unless a call's arguments are no JSON object (cut short): then the text, no calls."""
    return whole if all(is_object(a) for _, a in whole[1]) else (text, [])


@given(st.sampled_from([("hermes", t) for t in HERMES_TOKENS] + [("llama3_json", t) for t in LLAMA_TOKENS]),
       st.lists(st.integers(0, 400), max_size=12))
@settings(max_examples=300, deadline=None)
def test_a_stream_reads_the_same_cut_anywhere(case, places):
    """Hypothesis's cuts: several at once, anywhere."""
    parser, pieces = case
    text = "".join(pieces)
    places = sorted({p % (len(text) + 1) for p in places})
    cut = [text[a:b] for a, b in zip([0] + places, places + [len(text)])]
    assert streamed(cut, parser)[:2] == streamed([text], parser)[:2]


def test_content_and_arguments_go_out_as_they_come():
    """Text is held back only where it may begin a call; a call goes out when its name is known,
    its arguments piece by piece."""
    stream = tools.CallStream("hermes", NAMES)
    assert stream.feed("Let me look.") == [("content", "Let me look.")]
    assert stream.feed("\n<tool") == []  # (it may be a call: held)
    assert stream.feed('_call>\n{"name": "get_wea') == []
    [(kind, index, call)] = stream.feed('ther", "argu')  # its name is known: it goes out
    assert (kind, index, call.name, call.arguments) == ("call", 0, "get_weather", "")
    assert stream.feed('ments": {"ci') == [("arguments", 0, '{"ci')]
    assert stream.feed('ty": "Ver') == [("arguments", 0, 'ty": "Ver')]
    assert stream.feed('ona"}}\n</tool_call>') == [("arguments", 0, 'ona"}')]
    assert stream.finish() == [] and json.loads(stream.calls[0].arguments) == {"city": "Verona"}
    stream = tools.CallStream("hermes", NAMES)
    assert stream.feed("a <tool") == [("content", "a")] and stream.feed("kit") == [("content", " <toolkit")]


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


@pytest.mark.parametrize("parser, pieces", [("hermes", t) for t in HERMES_TOKENS] + [("llama3_json", t) for t in LLAMA_TOKENS])
def test_the_streamed_chunks_join_into_the_whole_answer(parser, pieces):
    """The server's chunks (responses.Shapes, a delta a piece) as a client joins them: the role
    first; a call's first chunk with its id, type, name and arguments "", then pieces of its
    arguments; the same content, calls and finish_reason as the answer not streamed."""
    from pagedcli.serve.engine_client import Delta
    from pagedcli.serve.responses import Answer, Shapes

    def shapes():
        s = Shapes(True, "chatcmpl-1", "demo", str, False)
        s.tools = (parser, NAMES)
        return s

    streamed, chunks = shapes(), []
    for i, piece in enumerate(pieces):
        out = streamed.chunk(Delta(0, [i], piece, [], "stop" if i == len(pieces) - 1 else None), not chunks)
        chunks += [json.loads(event[len("data: "):]) for event in (out or b"").decode().split("\n\n") if event]
    answer = Answer()
    answer.add(Delta(0, list(range(len(pieces))), "".join(pieces), [], "stop"))
    whole = shapes().whole([answer], {})["choices"][0]
    content, calls, finish = None, [], None
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function" and call["function"]["arguments"] == "" and call["index"] == len(calls)
                calls.append({"name": call["function"]["name"], "arguments": ""})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    if not all(is_object(c["arguments"]) for c in calls):  # a call cut short: the whole answer's text
        assert "tool_calls" not in whole["message"] and whole["message"]["content"] == "".join(pieces)
        return
    assert content == whole["message"]["content"] and finish == whole["finish_reason"]
    assert calls == [c["function"] for c in whole["message"].get("tool_calls", [])]


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Ver'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "not an object"}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Ver'),
])
def test_a_call_cut_short_or_malformed_stays_text_in_a_whole_answer(parser, text):
    """A call whose arguments are not a JSON object (max_tokens cut it, or the model wrote a string)
    is no call in a whole answer: the text comes back as content, so a client's json.loads of
    `arguments` never fails on what pagedcli returned."""
    content, calls = tools.parse(text, parser, NAMES)
    assert calls == [] and content == text
