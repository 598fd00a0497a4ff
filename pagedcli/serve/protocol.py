"""The request bodies the server takes, with OpenAI's field names and types (and vLLM's extra
sampling fields: top_k, min_p, repetition_penalty, ignore_eos).

Strict types, as OpenAI's API checks them: "10" is not a number and true is not an integer.
Fields the server does not know are let through and ignored (clients send `user`, `store` and
the like), as vLLM does. `parse` turns a body into a request or an APIError naming the field."""

from __future__ import annotations

import json
import re
import typing
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from pagedcli.core.options import SamplingParams, declared
from pagedcli.serve.errors import APIError, bad_request


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def null_is_left_out(cls, data):
        """A field given as null takes its default, as OpenAI's API reads it (`"n": null` is n 1,
        `"stream": null` no stream): clients that fill every field send nulls for the unset ones."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
    include_usage: bool = False  # a last chunk with `usage` and no choices
    continuous_usage_stats: bool = False  # vLLM's: every chunk with the usage so far (a chunk may hold
    # several tokens when its client fell behind: this counts them)


class JsonSchema(Body):
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")  # (`schema` is pydantic's own name)
    strict: Optional[bool] = None  # the schema is always held (as OpenAI's strict: true)
    description: Optional[str] = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: one of these."""

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class Request(Body):
    """What completions and chat share besides sampling."""

    model: Optional[str] = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # the answer held to a format: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (engine/structured.py)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's log-probability and the N likeliest
    # OpenAI's, not done here: read so that asking for it is a 400, not ignored (sampling.py)
    logit_bias: Optional[dict[str, Any]] = None


_HINTS = typing.get_type_hints(SamplingParams)
# SamplingParams' fields that a request may set (declared with api=True, core/options.py), each
# None by default: the server's default (its flags, the model's generation_config.json)
SAMPLING_FIELDS = tuple(f.name for f in declared(SamplingParams) if f.metadata["api"])
Sampling = create_model("Sampling", __base__=Request, __module__=__name__,
                        **{name: (Optional[_HINTS[name]], None) for name in SAMPLING_FIELDS})


class CompletionRequest(Sampling):
    # a text, several texts, token ids, or several lists of token ids (OpenAI's four forms)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # the chosen token's and this many likeliest tokens' log-probabilities
    echo: bool = False  # the prompt before the answer (with logprobs: the prompt tokens' too)
    # OpenAI's fields that this server does not do: read, so that asking for them is a 400, not ignored
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(Body):
    type: str
    text: Optional[str] = None


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls, as OpenAI gave them
    tool_call_id: Optional[str] = None  # a tool message's: the call it answers
    name: Optional[str] = None


class Function(Body):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: Function


class NamedTool(Body):
    type: Literal["function"] = "function"
    function: dict[str, Any]  # {"name": ...}


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM's: more variables for the chat template (e.g. Qwen3's enable_thinking), over the server's
    # --chat-template-kwargs
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedTool, None] = None
    parallel_tool_calls: Optional[bool] = None  # (calls are parsed as the model writes them, one or more)
    # OpenAI's older form of tools: read so that asking for it is a 400 (give `tools`), not free text
    functions: Optional[list[Any]] = None
    function_call: Union[str, dict[str, Any], None] = None


# a UTF-16 surrogate, as a JSON escape or as the bytes Python's json lets through (surrogatepass):
# most are halves of an escaped pair (an emoji), checked only where one may be
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse(raw: bytes, model: type[Body], before=None) -> Body:
    """The request in `raw`, or a 400 naming the first field that is wrong. `before`: a check of the
    JSON object before its fields are validated (a count that makes the rest not worth reading)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("the body is not valid JSON (it nests arrays or objects too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON ({e})") from None
    except ValueError:  # Python's limit on an integer's digits (4,300), which no field takes anyway
        raise bad_request("the body is not valid JSON (it has a number with thousands of digits)") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, not {type(data).__name__}")
    if before is not None:
        before(data)
    if SURROGATE.search(raw):
        check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise field_error(e) from None


def check_text(data: dict) -> None:
    """A 400 for a string with half of a UTF-16 surrogate pair (an escape such as "\\ud800" alone):
    it is no Unicode text, so no tokenizer or answer can take it."""
    todo = [("", data)]  # not recursive: the body may nest as deep as json.loads went
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key in value:
                unicode_error(key, f"a key in `{path}`" if path else "a key of the body", path or None)
            todo += reversed([(f"{path}.{k}" if path else k, v) for k, v in value.items()])
        elif isinstance(value, list):  # reversed: the first broken string is the one named
            todo += reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)])
        elif isinstance(value, str):
            unicode_error(value, f"`{path}`", path)


def unicode_error(text: str, what: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{what} is not valid Unicode text (a lone surrogate U+{ord(text[e.start]):04X} at character "
                          f"{e.start + 1})", param) from None


def field_error(e: ValidationError) -> APIError:
    error = e.errors()[0]
    path = field_path(error["loc"])
    if error["type"] == "missing":
        return bad_request(f"`{path}` is required", path)
    union = sum(1 for other in e.errors() if field_path(other["loc"]).startswith(path)) > 1
    why = "is not one of the types it takes" if union else error["msg"][0].lower() + error["msg"][1:]
    got = json.dumps(error.get("input"))[:60]
    return bad_request(f"`{path}`: {got} {why}".replace(" input should", " should"), path)


def field_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> messages[0].content; the member types pydantic puts in a
    union's path (`str`, `list[int]`) are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            path += f".{part}" if path else part
    return path
