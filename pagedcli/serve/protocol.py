"""The request bodies the server takes, with OpenAI's field names and types (and vLLM's extra
sampling fields: top_k, min_p, repetition_penalty, ignore_eos).

Strict types, as OpenAI's API checks them: "10" is not a number and true is not an integer.
Fields the server does not know are let through and ignored (clients send `user`, `store` and
the like), as vLLM does. `parse` turns a body into a request or an APIError naming the field."""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedcli.serve.errors import APIError, bad_request


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Body):
    include_usage: bool = False  # a last chunk with `usage` and no choices
    continuous_usage_stats: bool = False  # vLLM's: every chunk with the usage so far (a chunk may hold
    # several tokens when its client fell behind: this counts them)


class Sampling(Body):
    """What completions and chat share; None: the server's default (its flags, the model's
    generation_config.json)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    n: int = 1
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class CompletionRequest(Sampling):
    # a text, several texts, token ids, or several lists of token ids (OpenAI's four forms)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None  # the chosen token's and this many likeliest tokens' log-probabilities
    # OpenAI's fields that this server does not do: read, so that asking for them is a 400, not ignored
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(Body):
    type: str
    text: Optional[str] = None


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = None


def parse(raw: bytes, model: type[Body]) -> Body:
    """The request in `raw`, or a 400 naming the first field that is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise field_error(e) from None


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
