"""`pagedcli serve`: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn, the
`serve` extra). One idea a module:

- protocol.py       the request bodies, with OpenAI's field names and types (pydantic)
- sampling.py       a request's prompt and options -> token ids and SamplingParams, or a 400
- tools.py          tool calls: the tools into the chat template, the answer back into tool_calls (streamed as written)
- engine_process.py the one engine, in a process of its own: builds it, steps it, sends each turn's tokens
- engine_client.py  the API process's side of it: requests (Jobs) in, their tokens out to each one
- command_pipe.py   the pipe its commands go by, written from the event loop without blocking
- responses.py      OpenAI's response objects and stream chunks
- metrics.py        Prometheus text, with vLLM's metric names where it has one
- cache_view.py     /v1/cache: the cache snapshot as inspect-cache's JSON, per running request
- errors.py         OpenAI's error object
- app.py            the routes
- live.py           `serve --live`: the live view over the server's traffic, the access log above it

Nothing here is imported unless the server is started: pagedcli works without fastapi.
"""

import signal
import threading
from contextlib import contextmanager

MISSING = "pagedcli serve needs FastAPI and uvicorn"
INSTALL_HINT = "install them with: pip install 'pagedcli[serve]'"
# (only these two and what they need: the extra would reinstall torch too)
REINSTALL_HINT = "install them again with their dependencies: pip install --force-reinstall fastapi uvicorn"
DEFAULT_MAX_WAITING = 4096  # answers (n a request) waiting for a slot before the next request is refused (429)
# A request body larger than this is refused (413) before it is read (serve --max-request-size): 16
# prompts of 128k tokens as text or as token ids; what preparing one takes in the API process is a
# bounded multiple of it (docs/serve.md, "Limits")
DEFAULT_MAX_BODY_BYTES = 8 << 20
# The longest the engine process may say nothing (a step's message, or its heartbeat when idle) before
# /health answers 503 and its open requests end (serve --engine-timeout; vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)
ENGINE_TIMEOUT_S = 60.0
LOG_FORMAT = "%(levelname)s: %(message)s"  # the server's own log lines, in both of its processes
# what stops a server cleanly: Ctrl-C, a service manager's stop, its terminal hanging up (no SIGHUP on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def size_text(n: int) -> str:
    """A byte count as the server's messages say it: 8 MiB, 512 KiB, 100 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.4g} {unit}"
    return f"{n:,} bytes"


def ignore_stop_signals() -> dict:
    """The STOP_SIGNALS ignored in this process (main thread only); returns their handlers before.
    The server's other processes do this: a terminal or a service manager signals the whole process
    group, and the first API process alone decides how the server ends (it tells the others)."""
    return {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}


@contextmanager
def stop_signals_ignored():
    """While a child process starts (a spawn's exec keeps ignored signals): one sent to the group
    meanwhile must not kill it before it ignores them itself. (Only the main thread sets handlers:
    a test may start a server in another, and then nothing is changed.)"""
    previous = ignore_stop_signals() if threading.current_thread() is threading.main_thread() else {}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

