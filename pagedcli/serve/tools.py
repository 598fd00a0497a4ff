"""Tool calls on /v1/chat/completions: the tools rendered through the model's chat template (as
transformers passes `tools=` to it), the answer parsed back into OpenAI's `tool_calls`, and, for
`tool_choice` "required" or a named function, the answer held by a grammar to a call that parses.

Two forms of call, as vLLM's parsers of the same names read them, chosen from the chat template (or
`serve --tool-call-parser`):
- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number, text before them is the message's content;
- llama3_json (Llama 3.1, 3.2): the whole answer is `{"name": ..., "parameters": {...}}` (or
  "arguments"), several joined by `;`, after an optional `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pagedcli.engine.structured import JSON_LAYOUT

PARSERS = ("hermes", "llama3_json")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parser_for(template: str | None) -> str:
    """The form a chat template's model writes its calls in: hermes where the template speaks of
    <tool_call>, else Llama 3's JSON."""
    return "hermes" if template and "<tool_call>" in template else "llama3_json"


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
    """The answer's text split into (content, tool calls); no calls where none parses as a call of
    one of `names` (the text then stays the content, as vLLM leaves it)."""
    if parser == "hermes":
        calls = [_call(body, names) for body in HERMES_CALL.findall(text)]
        if not calls or None in calls:
            return text, []
        content = text[:text.index("<tool_call>")].strip()
        return content or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = [_call(part, names) for part in _json_objects(body)]
    if not calls or None in calls:
        return text, []
    return None, calls


def _json_objects(text: str) -> list[str]:
    """`{...}; {...}` as its objects' texts (a `;` inside a string is not a separator)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return [text]  # (not a list of objects: parsed, and refused, as one)
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return parts


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


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
