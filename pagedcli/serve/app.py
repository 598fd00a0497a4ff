"""The routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and /health,
/metrics and /v1/cache. Every request becomes a Job in the one engine (engine_client.py, which
talks to the engine's own process); a streamed one sends each delta as a server-sent event the
moment the engine's message with it is read. The two routes that run jobs are plain ASGI apps in
FastAPI's router (asgi.py says why).

A client that goes away (mid-stream, or while a whole answer is computed) has its job aborted,
which frees its blocks at the engine's next step. Errors are OpenAI's error object (errors.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pagedcli.core.errors import UsageError
from pagedcli.core.options import SamplingParams
from pagedcli.engine.structured import StructuredOutputs
from pagedcli.serve import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, ENGINE_TIMEOUT_S, cache_view, tools
from pagedcli.serve.asgi import Endpoint, EventStream, watch_for_hang_up
from pagedcli.serve.engine_client import ClientGone, EngineClient, Job, hung_message
from pagedcli.serve.engine_process import Ready
from pagedcli.serve.errors import (
    APIError,
    bad_request,
    not_allowed,
    not_found,
    server_error,
    too_large,
    too_many_waiting,
    unauthorized,
)
from pagedcli.serve.metrics import Metrics
from pagedcli.serve.protocol import ChatRequest, CompletionRequest, parse
from pagedcli.serve.responses import NO_USAGE, Answer, Shapes, failure, new_id, sse, usage
from pagedcli.serve.sampling import (
    Prompts,
    chat_prompt,
    check_answer_count,
    completion_prompts,
    longest_text,
    request_params,
)

log = logging.getLogger("pagedcli.serve")
CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection (logged only)
# A body past this size is parsed and tokenized in a worker thread (the tokenizer lets go of the GIL),
# so that a long text does not stall every other answer's stream for seconds meanwhile
OFF_LOOP_BYTES = 1 << 16
# A body past this size is prepared alone (the others past it wait), and the memory its parsing and
# tokenizing took is given back to the system after it (glibc keeps it otherwise): the API process's
# memory stays within a bound of the largest body the server takes (docs/serve.md, "Limits")
BIG_BODY_BYTES = 1 << 20
GET = ["GET", "HEAD"]


@dataclass
class Settings:
    model_name: str
    defaults: SamplingParams  # for what a request leaves out: the flags, the model's generation_config
    api_key: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413, unread
    engine_timeout_s: float = ENGINE_TIMEOUT_S  # the engine's longest silence before /health is a 503
    tool_call_parser: str | None = None  # hermes or llama3_json (serve/tools.py); None: from the chat template


def create_app(engine: EngineClient, ready: Ready, settings: Settings, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="pagedcli", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer, limits = ready.tokenizer, ready.limits
    started = int(time.time())
    engine.timeout_s = settings.engine_timeout_s
    room = (ready.max_slots, settings.max_waiting)  # the answers a request may ask for at most: slots + waiting
    # the longest prompt text that may fit the model's length, told before it is tokenized (None: no such bound)
    max_chars = longest_text(tokenizer, limits.max_model_len) if tokenizer is not None else None
    big_bodies = asyncio.Semaphore(1)
    # the form the model writes tool calls in (serve/tools.py), and a grammar checker for requests'
    # formats, made at the first that asks (the engine's process compiles them again for itself)
    tool_parser = settings.tool_call_parser or tools.parser_for(tokenizer.chat_template if tokenizer else None)
    grammars: list[StructuredOutputs] = []

    def token_text(token_id: int) -> str:  # a token's own text, for log-probabilities
        if tokenizer is None:  # random weights: vLLM's spelling of a token without text
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request: Request, _e: ClientDisconnect):  # it went away before its body came whole
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # 404, 405: OpenAI's shape too
        if e.status_code == 404:
            error = not_found(request.url.path)
        elif e.status_code == 405:
            error = not_allowed(request.method, request.url.path, e.headers.get("Allow", ""))
        else:
            error = APIError(str(e.detail), e.status_code)
        return JSONResponse(error.body(), error.status, headers=e.headers)  # (a 405's Allow)

    if settings.api_key is not None:
        app.add_middleware(BearerKey, key=settings.api_key)

    get = app.api_route  # GET routes take HEAD too (HTTP asks it of every server; monitors probe with it)

    @get("/health", methods=GET)
    async def health():
        """200 while the engine process answers: 503 once it has died, or while it has said nothing
        (not even its heartbeat) for longer than --engine-timeout (engine_client.py)."""
        if not engine.alive:
            return Response("the engine has stopped", 503)
        if (silent := engine.silence()) is not None:
            return Response(hung_message(silent), 503)
        return Response(status_code=200)

    served_model = {"id": settings.model_name, "object": "model", "created": started, "owned_by": "pagedcli",
                    "max_model_len": limits.max_model_len}

    @get("/v1/models", methods=GET)
    async def models():
        return {"object": "list", "data": [served_model]}

    @get("/v1/models/{name:path}", methods=GET)  # OpenAI's retrieve (a model's name may hold slashes)
    async def model(name: str):
        check_model(name)
        return served_model

    @get("/metrics", methods=GET)
    async def metrics_text():
        return PlainTextResponse(metrics.render(engine.num_waiting), media_type="text/plain; version=0.0.4")

    @get("/v1/cache", methods=GET)
    async def cache():
        snap = await engine.snapshot()
        return await asyncio.to_thread(cache_view.to_json, snap, tokenizer)

    async def completions(request: Request):
        req, token_ids, texts = await off_loop_if_big(await read_body(request), completion_request)
        return await run(request, req, token_ids, texts, chat=False, want_logprobs=req.logprobs is not None)

    async def chat_completions(request: Request):
        req, token_ids, texts = await off_loop_if_big(await read_body(request), chat_request)
        return await run(request, req, token_ids, texts, chat=True, want_logprobs=req.logprobs)

    async def read_body(request: Request) -> bytes:
        """The body, or a 413 as soon as it is known to pass --max-request-size: from its
        Content-Length before a byte of it is read, else once what came passes it."""
        limit = settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large(int(length), limit)
        pieces, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_large(None, limit)
            pieces.append(piece)
        return b"".join(pieces)

    app.add_route("/v1/completions", Endpoint(completions), methods=["POST"])
    app.add_route("/v1/chat/completions", Endpoint(chat_completions), methods=["POST"])

    def completion_request(raw: bytes):
        req = parse(raw, CompletionRequest, lambda data: check_answer_count(data, room))  # before 2M prompts are read
        check_model(req.model)
        return req, *completion_prompts(req, tokenizer, max_chars)

    def chat_request(raw: bytes):
        req = parse(raw, ChatRequest)
        check_model(req.model)
        return req, *chat_prompt(req, tokenizer, settings.model_name, max_chars)

    async def off_loop_if_big(raw: bytes, prepare):
        if len(raw) <= OFF_LOOP_BYTES:
            return prepare(raw)
        if len(raw) <= BIG_BODY_BYTES:
            return await asyncio.to_thread(prepare, raw)
        async with big_bodies:
            try:
                return await asyncio.to_thread(prepare, raw)
            finally:
                del raw
                await asyncio.to_thread(give_memory_back)

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(f"`model` {name!r}: this server serves {settings.model_name!r} (GET /v1/models)", 404,
                           "model", code="model_not_found")

    async def run(request: Request, req, token_ids, texts, chat: bool, want_logprobs: bool):
        params = request_params(req, settings.defaults, limits, token_ids, tokenizer is not None, room, tool_parser)
        if params[0][0].structured is not None:
            await asyncio.to_thread(check_format, params[0][0].structured)
        prompts = Prompts(token_ids, texts, params)
        if engine.waiting_with(prompts.num_answers) > settings.max_waiting:
            raise too_many_waiting(settings.max_waiting, engine.num_waiting, prompts.num_answers)
        request_id = request.headers.get("x-request-id") or new_id("chatcmpl" if chat else "cmpl")
        job = Job(request_id, prompts, tokenizer)
        shapes = Shapes(chat, request_id, settings.model_name, token_text, want_logprobs,
                        tokenizer.token_bytes if tokenizer is not None else None)
        if not chat and req.echo:  # the prompt before each answer; max_tokens 0: the prompt alone
            shapes.echo = (token_ids, texts, req.max_tokens == 0, req.n)
        if req.prompt_logprobs is not None:
            shapes.prompt_logprobs_of = (token_ids, req.n)
        if chat and req.tools and req.tool_choice != "none":
            shapes.tools = (tool_parser, {t.function.name for t in req.tools})
        num_prompt_tokens = sum(len(ids) for ids in token_ids)
        headers = {"X-Request-Id": request_id}
        if req.stream:
            options = req.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = include_usage and options.continuous_usage_stats
            return EventStream(engine, job, events(job, shapes, num_prompt_tokens, include_usage, continuous), headers)
        return await whole(request, job, shapes, num_prompt_tokens, headers)

    def check_format(structured: tuple[str, str]) -> None:
        """A format that does not compile is the request's 400, here, before the engine sees it."""
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: its answers cannot be held to a format", "response_format")
        if not grammars:
            grammars.append(StructuredOutputs(tokenizer.to_json(), limits.vocab_size or tokenizer.vocab_size,
                                              ready.stop_ids))
        try:
            grammars[0].matcher(*structured)
        except UsageError as e:
            raise bad_request(e.message, "response_format") from None

    async def events(job: Job, shapes: Shapes, num_prompt_tokens: int, include_usage: bool, continuous: bool):
        """The SSE body (EventStream submits the job, and aborts it if the client goes away). A
        bug past the first byte ends it with an error event and [DONE], as vLLM's stream does, not
        a cut connection (the answer's status, 200, has gone out already)."""
        started = [False] * job.prompts.num_answers
        num_tokens = 0
        try:
            while not job.done:
                for delta in await job.receive():
                    if (error := failure(delta)) is not None:
                        yield sse(error.body())
                        continue
                    num_tokens += len(delta.token_ids)
                    counted = (usage(num_prompt_tokens, num_tokens) if continuous
                               else None if include_usage else NO_USAGE)
                    chunk = shapes.chunk(delta, not started[delta.index], counted)
                    if chunk is not None:  # (None: held back, a tool call's text until its end)
                        yield chunk
                        started[delta.index] = True
        except ClientGone:
            raise
        except Exception as e:
            log.exception("streaming %s failed", job.request_id)
            yield sse(server_error(f"the stream failed: {type(e).__name__}: {e}").body())
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(shapes.usage_chunk(usage(num_prompt_tokens, num_tokens)))
        yield sse("[DONE]")

    async def whole(request: Request, job: Job, shapes: Shapes, num_prompt_tokens: int, headers: dict) -> Response:
        engine.submit(job)
        answers = [Answer() for _ in range(job.prompts.num_answers)]
        watch = watch_for_hang_up(request.receive, job)
        try:
            while not job.done:
                for delta in await job.receive():
                    if (error := failure(delta)) is not None:
                        raise error
                    answers[delta.index].add(delta)
        except ClientGone:  # nobody reads the answer
            return Response(status_code=CLIENT_GONE)
        finally:
            watch.cancel()
            if not job.done:
                engine.abort(job)
        counted = 0 if shapes.echo and shapes.echo[2] else sum(a.num_tokens for a in answers)  # (max_tokens 0)
        body = shapes.whole(answers, usage(num_prompt_tokens, counted))
        return JSONResponse(body, headers=headers)

    return app


def give_memory_back() -> None:
    """What the C heap holds free goes back to the system (glibc's malloc_trim): the tokenizer's and
    the parser's memory for a large body, which would otherwise stay with the process."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class BearerKey:
    """The API key, checked on /v1 before a route runs, as a plain ASGI middleware: Starlette's
    `@app.middleware("http")` passes every streamed chunk through a memory stream and a task of its
    own, which cost the served path much of its tokens/s under many streams
    (docs/performance-log.md, "The host's own work")."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"bearer {key}".encode()  # the scheme's case does not count

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if not hmac.compare_digest(scheme.lower() + b" " + token, self.expected):
                e = unauthorized(given=bool(given))
                await JSONResponse(e.body(), e.status, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)

