"""OpenAI's error object: {"error": {"message", "type", "param", "code"}}, with the HTTP status.

A mistake in a request is a 400 naming the field (`param`) and the value, as the command line's
one-line errors do; the server and every other request go on."""

from __future__ import annotations

from dataclasses import dataclass

from pagedcli.core.errors import plural


@dataclass
class APIError(Exception):
    message: str
    status: int = 400
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param, code=code)


def unauthorized(given: bool = True) -> APIError:
    # OpenAI's answer to a wrong key: 401, type invalid_request_error, code invalid_api_key
    what = "Incorrect API key provided" if given else "This server needs an API key"
    return APIError(f"{what} (give it as the header `Authorization: Bearer KEY`)", 401, code="invalid_api_key")


def too_many_waiting(limit: int, waiting: int, answers: int) -> APIError:
    """429: the request's `answers` would take the `waiting` answers past the server's --max-waiting."""
    return APIError(f"the server has {plural(waiting, 'answer')} waiting for a slot already, and this request's "
                    f"{plural(answers, 'answer')} would pass its --max-waiting ({limit:,}); try again shortly", 429,
                    type="rate_limit_exceeded", code="rate_limit_exceeded")


def too_large(size: int | None, limit: int) -> APIError:
    """413: a body larger than the server takes (`size`: its Content-Length, None when unsaid)."""
    from pagedcli.serve import size_text

    what = f"the request body ({size_text(size)})" if size is not None else "the request body"
    return APIError(f"{what} is larger than the {size_text(limit)} this server takes (its --max-request-size); "
                    "send fewer or shorter prompts", 413, code="request_too_large")


def not_found(path: str) -> APIError:
    return APIError(f"no route {path}", 404, type="not_found_error")


def not_allowed(method: str, path: str, allow: str) -> APIError:
    return APIError(f"{method} {path}: not allowed here (it takes {allow})", 405)


def server_error(message: str) -> APIError:
    return APIError(message, 500, type="server_error")
