"""The two routes every token goes through, POST /v1/completions and /v1/chat/completions, as
plain ASGI apps in FastAPI's router (its 404s and 405s, and its exception handlers for what a route
raises before its answer starts, still apply).

Why not FastAPI's routes and Starlette's StreamingResponse: FastAPI's handling of a request (its
dependency solving and response wrapping), the streaming response's task group, and that task
group's work for every event all fall on the one core the event loop has
(docs/performance-log.md, "The host's own work"). With a burst of requests arriving at once, the
last prompt reached the engine long after its request, and a stream's job was only submitted once
the response's task first ran, after every request queued behind it."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request

from pagedcli.serve.engine_client import ClientGone, EngineClient, Job

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Endpoint:
    """`handle(request) -> response` as the ASGI app a Starlette Route calls as it is."""

    def __init__(self, handle: Callable[[Request], Awaitable]):
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        response = await self.handle(Request(scope, receive))
        await response(scope, receive, send)


class EventStream:
    """A streamed answer, as server-sent events: the job is submitted the moment the route's
    response is called, each event is one `send`, one task watches for the client hanging up
    (Job.hang_up: its receive raises ClientGone), and the job is aborted on the way out unless
    it has ended."""

    def __init__(self, engine: EngineClient, job: Job, events: AsyncIterator[bytes], headers: dict[str, str]):
        self.engine, self.job, self.events = engine, job, events
        self.headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        job = self.job
        self.engine.submit(job)  # (a 503 raised here is still an HTTP error: nothing has been sent)
        watch = watch_for_hang_up(receive, job)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass  # nobody to write to
        finally:
            watch.cancel()
            if not job.done:
                self.engine.abort(job)


def watch_for_hang_up(receive, job: Job) -> asyncio.Future:
    """A task that tells `job` when its client closes the connection (the request's body has
    been read: what the server receives next is the disconnect)."""

    async def until_disconnected():
        while (await receive())["type"] != "http.disconnect":
            pass
        job.hang_up()

    return asyncio.ensure_future(until_disconnected())
