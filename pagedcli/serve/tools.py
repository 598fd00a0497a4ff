"""Tool calls on /v1/chat/completions: the tools rendered through the model's chat template (as
transformers passes `tools=` to it), the answer parsed back into OpenAI's `tool_calls` as it is
written (CallStream: a call goes out once its name is known, its arguments piece by piece, as
OpenAI streams them; the whole answer is the same parser fed at once), and, for `tool_choice`
"required" or a named function, the answer held by a grammar to a call that parses.

Two forms of call, as vLLM's parsers of the same names read them, chosen from the chat template (or
`serve --tool-call-parser`):
- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number, text before them is the message's content;
- llama3_json (Llama 3.1, 3.2): the whole answer is `{"name": ..., "parameters": {...}}` (or
  "arguments"), several joined by `;`, after an optional `<|python_tag|>`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from pagedcli.engine.structured import JSON_LAYOUT

PARSERS = ("hermes", "llama3_json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes's tags around a call
PYTHON_TAG = "<|python_tag|>"  # what Llama 3 may write before its calls
ARGUMENT_KEYS = ("arguments", "parameters")


def parser_for(template: str | None) -> str:
    """The form a chat template's model writes its calls in: hermes where the template speaks of
    <tool_call>, else Llama 3's JSON."""
    return "hermes" if template and OPEN in template else "llama3_json"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + secrets.token_hex(12)

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


def parse(text: str, parser: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The answer's text split into (content, tool calls): what CallStream makes of it fed at once,
    so that a streamed answer and a whole one are the same calls. Without calls the content is the
    text as it is; with calls, None where no text is left beside them."""
    stream = CallStream(parser, names)
    events = stream.feed(text) + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    if not all(_json_object(call.arguments) for call in stream.calls):
        # a call cut short (max_tokens) or malformed: a whole answer keeps it as text, as vLLM's does,
        # so a client's json.loads of `arguments` never fails (a stream has sent the call's start)
        return text, []
    return (content or None) if stream.calls else content, stream.calls


def _json_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class _Value:
    """Where a JSON value written one character at a time ends (its depth, its strings and their
    escapes): take(c) is 1 where c is part of it and it goes on, 2 where c ends it, 0 where it had
    ended before c (a number, true, false, null end at the character after them)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.scalar, self.started = 0, False, False, False, False

    def take(self, c: str) -> int:
        if not self.started:
            self.started = True
            if c in "{[":
                self.depth = 1
            elif c == '"':
                self.in_string = True
            else:
                self.scalar = True
            return 1
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                return 2 if self.depth == 0 else 1
            return 1
        if self.scalar:
            return 0 if c in ",}] \t\n\r" else 1
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return 2 if self.depth == 0 else 1
        return 1


# the states inside a call's JSON object, where its characters are held until it is known to be a call
_IN_CALL = {"open", "key_or_end", "key_start", "key", "colon", "value_start", "name", "arguments",
            "argument_string", "skip", "after_value"}


class CallStream:
    """One answer's text, fed as the model writes it, split at once into what OpenAI streams:
    ("content", text), ("call", index, ToolCall) when a call's name is known (its arguments still
    ""), ("arguments", index, piece) as its arguments are written. The pieces of a call's arguments
    join into its `arguments`: the JSON text as the model writes it (a JSON string of arguments,
    decoded, comes whole when it ends).

    A call is a JSON object with a "name" among the tools' and its "arguments" (or "parameters"):
    after `<tool_call>` (hermes), or at the answer's start, after an optional <|python_tag|>, and
    after a `;` that follows a call (llama3_json). Text that may begin one is held back (a partial
    `<tool_call>`, the whitespace before it); so is an object until its name is known: one that
    turns out to be no call (not JSON of that shape, a name that is no tool's) goes out as content,
    as it was written. Once its name has gone out a call stands: text that breaks its object after
    that ends it (hermes: up to `</tool_call>`, which is dropped). Whitespace between calls is
    dropped; any other text beside them is content."""

    def __init__(self, parser: str, names: set[str]):
        self.hermes = parser == "hermes"
        self.names = names
        self.calls: list[ToolCall] = []
        self.state = "text" if self.hermes else "start"
        self.tail = ""  # text held back: what may begin a marker, the whitespace before it
        self.pending = ""  # the text of a call whose name is not known yet (content, if it is no call)
        self.events: list = []
        self._new_call()

    def _new_call(self) -> None:
        self.call: ToolCall | None = None  # once its name is known
        self.name: str | None = None
        self.arguments: str | None = None  # arguments written before the name (held until it comes)
        self.arguments_seen = False
        self.key = ""
        self.raw = ""  # a key's or a string value's JSON text, until it closes
        self.value = _Value()

    def feed(self, text: str) -> list:
        """The events `text` (the answer's next piece) brings, consecutive pieces of a kind joined."""
        for c in text:
            if self.state in _IN_CALL and self.call is None:
                self.pending += c
            self._step(c)
        events, self.events = self.events, []
        return events

    def finish(self) -> list:
        """The events at the answer's end: what was held back that is content."""
        if self.state in _IN_CALL and self.call is None:  # an object cut short: no call
            self._content(self.pending)
        elif self.state in ("text", "start", "content") and (self.tail.strip() or not self.calls):
            self._content(self.tail)
        self.tail = self.pending = ""
        events, self.events = self.events, []
        return events

    # --- what goes out ----------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if text:
            if self.events and self.events[-1][0] == "content":
                self.events[-1] = ("content", self.events[-1][1] + text)
            else:
                self.events.append(("content", text))

    def _argument_piece(self, text: str) -> None:
        if self.call is None:
            self.arguments = (self.arguments or "") + text
            return
        self.call.arguments += text
        index = len(self.calls) - 1
        if self.events and self.events[-1][0] == "arguments" and self.events[-1][1] == index:
            self.events[-1] = ("arguments", index, self.events[-1][2] + text)
        else:
            self.events.append(("arguments", index, text))

    def _commit(self) -> None:
        """The call's name is known and is a tool's: it goes out."""
        self.call = ToolCall(self.name, "")
        self.calls.append(self.call)
        self.events.append(("call", len(self.calls) - 1, self.call))
        self.pending = ""
        if self.arguments is not None:
            arguments, self.arguments = self.arguments, None
            self._argument_piece(arguments)

    def _no_call(self, c: str | None) -> None:
        """The object is not a call, or not one any more: its text so far goes out as content (or, a
        call that went out, ends), and `c` (None: taken by the object) is read again as text."""
        if self.call is None:
            self._content(self.pending[:-1] if c is not None else self.pending)
            self.pending = ""
            self.state = "text" if self.hermes else "content"
        else:
            self._end_call()
            self.state = "skip_to_close" if self.hermes else "content"
        self._new_call()
        if c is not None:
            self._step(c)

    def _end_call(self) -> None:
        if not self.arguments_seen:
            self._argument_piece("{}")  # (a call written without arguments: none)

    # --- reading ----------------------------------------------------------------------------------
    def _step(self, c: str) -> None:
        state = self.state
        if state == "text":  # hermes: content, until <tool_call>
            self.tail += c
            k = _marker_start(self.tail, OPEN)
            before = self.tail[:len(self.tail) - k]
            keep = len(before.rstrip())
            if k == len(OPEN):
                self._content(before[:keep])
                self.pending, self.tail, self.state = self.tail[keep:], "", "open"
            else:
                self._content(self.tail[:keep])
                self.tail = self.tail[keep:]
        elif state in ("start", "next"):  # llama3_json: a call at the start, or after `;`
            self.tail += c
            rest = self.tail.lstrip()
            if state == "start" and rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip()
            elif state == "start" and PYTHON_TAG.startswith(rest):
                return
            if not rest:
                return
            if rest == "{":
                self.pending, self.tail, self.state = self.tail, "", "key_or_end"
            else:
                self.state = "content"
                self._content(self.tail)
                self.tail = ""
        elif state == "content":
            self._content(c)
        elif state in ("close", "between"):  # after a call: `</tool_call>` (hermes), `;` (llama3_json)
            self.tail += c
            rest = self.tail.lstrip()
            if self.hermes and rest and CLOSE.startswith(rest):
                if rest == CLOSE:
                    self.tail, self.state = "", "text"
            elif not self.hermes and rest == ";":
                self.tail, self.state = "", "next"
            elif rest:  # anything else is text again
                held, self.tail = self.tail, ""
                self.state = "text" if self.hermes else "content"
                for h in held:
                    self._step(h)
        elif state == "skip_to_close":  # a call that broke off: the rest of its tag is dropped
            self.tail += c
            k = _marker_start(self.tail, CLOSE)
            self.tail = "" if k == len(CLOSE) else self.tail[len(self.tail) - k:]
            if k == len(CLOSE):
                self.state = "text"
        elif c in " \t\n\r" and state in ("open", "key_or_end", "key_start", "colon", "value_start", "after_value"):
            return
        elif state == "open":
            if c == "{":
                self.state = "key_or_end"
            else:
                self._no_call(c)
        elif state in ("key_or_end", "key_start"):
            if c == '"':
                self.raw, self.value, self.state = c, _Value(), "key"
                self.value.take(c)
            elif c == "}" and state == "key_or_end":
                self._object_end()
            else:
                self._no_call(c)
        elif state == "key":
            self.raw += c
            if self.value.take(c) == 2:
                self.key, self.state = _string(self.raw), "colon"
        elif state == "colon":
            if c == ":":
                self.state = "value_start"
            else:
                self._no_call(c)
        elif state == "value_start":
            self.value = _Value()
            if self.key == "name" and self.name is None:
                if c != '"':
                    return self._no_call(c)
                self.raw, self.state = c, "name"
            elif self.key in ARGUMENT_KEYS and not self.arguments_seen:
                self.arguments_seen = True
                if c == '"':
                    self.raw, self.state = c, "argument_string"
                else:
                    self.state = "arguments"
                    self._argument_piece(c)
            else:
                self.state = "skip"
            self.value.take(c)
        elif state in ("name", "argument_string"):
            self.raw += c
            if self.value.take(c) == 2:
                text = _string(self.raw)
                self.state = "after_value"
                if state == "argument_string":  # (some models write the arguments as a JSON string)
                    self._argument_piece(text or "")
                elif text not in self.names:
                    self._no_call(None)
                else:
                    self.name = text
                    self._commit()
        elif state in ("arguments", "skip"):
            taken = self.value.take(c)
            if taken and state == "arguments":
                self._argument_piece(c)
            if taken != 1:
                self.state = "after_value"
                if taken == 0:
                    self._step(c)
        elif state == "after_value":
            if c == ",":
                self.state = "key_start"
            elif c == "}":
                self._object_end()
            else:
                self._no_call(c)

    def _object_end(self) -> None:
        if self.call is None:  # an object without a tool's name
            return self._no_call(None)
        self._end_call()
        self._new_call()
        self.state = "close" if self.hermes else "between"


def _string(raw: str) -> str | None:
    """A JSON string's value; None where its escapes are not JSON's."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (the whole marker included)."""
    for k in range(min(len(text), len(marker)), 0, -1):
        if marker.startswith(text[-k:]) if k < len(marker) else text.endswith(marker):
            return k
    return 0


def call_schema(tools: list[dict], parser: str) -> dict:
    """The JSON schema of one call of one of `tools` (OpenAI's {"type": "function", "function": {...}}).
    Arguments are held to the parameters the tool declares: no others, unless its schema says so
    (as OpenAI's strict function calling has it)."""
    key = "arguments" if parser == "hermes" else "parameters"
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", key],
                       "properties": {"name": {"const": t["function"]["name"]}, key: _declared(t)}}
                      for t in tools]}


def _declared(tool: dict) -> dict:
    parameters = dict(tool["function"].get("parameters") or {"type": "object", "properties": {}})
    if parameters.get("type") == "object":
        parameters.setdefault("additionalProperties", False)
    return parameters


def constraint(tools: list[dict], parser: str) -> tuple[str, str]:
    """SamplingParams.structured for an answer that must be one call of one of `tools`: Hermes's
    tags around it, or the bare JSON object for Llama 3."""
    schema = call_schema(tools, parser)
    if parser == "llama3_json":
        return "json", json.dumps(schema)
    schema["x-guidance"] = JSON_LAYOUT  # (inside a grammar, the JSON's layout goes with its schema)
    return "grammar", f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


def template_tools(tools: list[dict]) -> list[dict]:
    """The tools as chat templates take them: OpenAI's objects, as transformers passes them."""
    return [{"type": "function", "function": t["function"]} for t in tools]


def template_messages(messages: list[dict]) -> list[dict]:
    """An assistant's tool_calls with their arguments as objects (templates write them with tojson,
    OpenAI sends JSON text); a tool message's result as its content."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except ValueError:
                        pass
                calls.append(dict(call) | {"function": function})
            m["tool_calls"] = calls
        out.append(m)
    return out
