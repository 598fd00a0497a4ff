"""`pagedcli bench --url`: the bench's workload sent to a running OpenAI-compatible server
(`pagedcli serve`, vLLM, llama.cpp's server), timed at the client as vLLM's serving benchmark times it.

Each request is a streamed `POST /v1/completions` whose prompt is the token ids the in-process bench
would feed (measure.requests_for, so the two runs send the same prompts and lengths), with
`ignore_eos` and `min_tokens` (vLLM's benchmark sends both) so every answer runs to its length, and
`stream_options.include_usage` for the server's own count of the tokens it wrote. At most `batch`
requests are open at once; with a `request_rate` they arrive as the in-process bench's seeded Poisson
process (arrivals.py). A request's time to first token counts from its arrival, a wait for a free
client included, as the in-process bench counts a wait for a free slot; inter-token latency is the
time between the stream's chunks (`pagedcli serve` sends a chunk a step, with the tokens of the steps
since a lagging client's last read merged into one).

A server that is not there, or does not answer as an OpenAI server does, is one RunError; a request
that fails (an HTTP error, an error event, a connection lost) is counted and its message kept, and
the figures are those of the requests that succeeded.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import signal
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable
from urllib.parse import urlsplit

from pagedcli.bench.arrivals import arrival_times
from pagedcli.bench.measure import Request, Workload, requests_for, summarize
from pagedcli.core.errors import RunError, UsageError, plural

CONNECT_TIMEOUT_S = 10.0  # to connect; and GET /v1/models's whole answer, which a server gives at once
READ_TIMEOUT_S = 600.0  # the longest wait for a stream's next chunk: a long queue before the first token is no fault
PROGRESS_EVERY_S = 0.25  # the progress callback's period (not a call per token: a GPU streams far too many)
WARM_UP_TOKENS = 4
# Parsing the streams is Python, through httpx, on one core a process: more streams than this are
# spread over processes, each its share (a GPU server writes more chunks than one parses; at twice
# this a process the busiest one was mostly busy: docs/performance-log.md, "The host's own work")
STREAMS_PER_PROCESS = 8
# a client process's CPU time over the run's wall time past which the figures may be the client's limit
CLIENT_BUSY = 0.9


# --- the server ----------------------------------------------------------------------------------
def base_url(url: str) -> str:
    """`url` as the root the /v1 paths hang from: http://host:port, a trailing / or /v1 taken off."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--url {url!r} is not an http(s) address", "e.g. --url http://127.0.0.1:8000")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def _client(url: str, api_key: str | None, connections: int):
    try:
        import httpx
    except ImportError:
        raise UsageError("bench --url needs httpx", "pip install httpx") from None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=url, headers=headers,
        timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        # as many connections as streams open at once (httpx's default pool stops at 100)
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False)  # no proxy from the environment between a benchmark and its server


def _error_text(response) -> str:
    """An error response as one short line: OpenAI's error object's message, FastAPI's detail, or the body."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict):
        inner = body.get("error", body.get("detail", body))
        body = inner.get("message", inner) if isinstance(inner, dict) else inner
    text = " ".join(str(body).split()) or response.reason_phrase
    return f"HTTP {response.status_code}: {text[:200]}"


async def served_models(client, url: str) -> list[dict]:
    """GET /v1/models: the model cards the server lists (each with an `id`), or one RunError saying
    why this is not an OpenAI-compatible server answering."""
    import httpx

    try:
        # (its own timeout: the client's read timeout is the streams', 600 s)
        response = await client.get("/v1/models", timeout=CONNECT_TIMEOUT_S)
    except httpx.ConnectTimeout:
        raise RunError(f"could not connect to the server at {url} within {CONNECT_TIMEOUT_S:g} s",
                       "is it running and reachable? check --url") from None
    except httpx.TimeoutException:
        raise RunError(f"the server at {url} took the connection but sent no answer to GET /v1/models within "
                       f"{CONNECT_TIMEOUT_S:g} s", "is it still loading, or stuck (its /health)? try again, "
                       "or check --url") from None
    except httpx.HTTPError as e:
        raise RunError(f"no server answers at {url} ({_first_line(e)})",
                       "start one with `pagedcli serve`, or check --url") from None
    if response.status_code in (401, 403):
        raise RunError(f"{url}/v1/models: {_error_text(response)}", "pass the server's key with --api-key")
    if response.status_code != 200:
        raise RunError(f"{url}/v1/models: {_error_text(response)}",
                       "--url must name an OpenAI-compatible server (pagedcli serve, vllm serve, llama-server)")
    try:
        cards = response.json()["data"]
        if not cards or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise RunError(f"{url}/v1/models did not list models as an OpenAI-compatible server does",
                       "--url must name an OpenAI-compatible server (pagedcli serve, vllm serve, llama-server)") from None
    return cards


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:120]


def pick_model(cards: list[dict], wanted: str | None, notice: Callable[[str], None]) -> dict:
    """The card to ask for: the one `wanted` (--model) names, else the server's first."""
    ids = [c["id"] for c in cards]
    for card in cards:
        if card["id"] == wanted:
            return card
    if wanted is not None and len(cards) > 1:
        raise UsageError(f"--model {wanted}: the server serves {', '.join(ids)}", "pass one of them, or leave --model out")
    if len(cards) > 1:
        notice(f"the server serves {', '.join(ids)}: benching {ids[0]} (--model picks another)")
    return cards[0]


def prompt_model(served_id: str, wanted: str | None, with_tokenizer: bool = False):
    """What random prompts are drawn from (as the in-process bench draws them): the vocabulary and stop
    ids of --model, else of the model the server names when it is one here (`demo`, `random:<preset>`,
    a folder, a cached Hub model: nothing is downloaded for a name only guessed from the server);
    the tokenizer too (`with_tokenizer`: for --prompt-file). A stand-in for measure.Model with what
    requests_for reads."""
    from pagedcli.model.source import found_here, resolve_model

    spec = wanted or served_id
    if wanted is not None and wanted != served_id and found_here(served_id):
        raise UsageError(f"--model {wanted}: the server serves {served_id!r}, which is here too: the prompts must be "
                         "drawn from the served model's vocabulary", "leave --model out")
    if wanted is None and not found_here(spec):
        raise UsageError(f"the server serves {served_id!r}, not a model found here: the prompts are drawn from its "
                         f"vocabulary", "pass the same model with --model (a folder, Hub id, demo or random:<preset>)")
    source = resolve_model(spec)
    tokenizer = source.read_tokenizer() if with_tokenizer else None
    return SimpleNamespace(source=source, tokenizer=tokenizer)


# --- one request ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One request as the client saw it (times: time.perf_counter)."""

    arrival: float  # when it was due (its place in the arrivals), not when a client was free to send it
    token_times: list[float] = field(default_factory=list)  # each chunk that carried a token
    completion_tokens: int | None = None  # the server's count (usage), when it gives one
    error: str | None = None
    timed_out: bool = False  # the error is a wait that ran out

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)


def completion_body(model: str, r: Request, ignore_eos: bool) -> dict:
    # greedy, as the in-process bench samples (OpenAI's default temperature is 1)
    body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # vLLM's extensions; a server that knows neither may end answers early (fewer tokens counted)
        body |= {"ignore_eos": True, "min_tokens": r.max_tokens}
    return body


async def stream_completion(client, body: dict, arrival: float, on_token: Callable[[], None] = lambda: None) -> Outcome:
    """Send one streamed completion and time its chunks; a failure is the Outcome's error, never raised."""
    import httpx

    out = Outcome(arrival)
    answered = False  # the response's status line came
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            answered = True
            if response.status_code != 200:
                await response.aread()
                out.error = _error_text(response)
                return out
            async for line in event_lines(response):
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    return out
                try:
                    chunk = json.loads(data)
                    if "error" in chunk:  # vLLM's and others' in-stream failure
                        error = chunk["error"]
                        out.error = f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
                        return out
                    # a chunk with a choice carries a token, unless it only ends the answer (finish_reason
                    # with no text); a token's text may be empty (the first bytes of a character)
                    if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or []):
                        out.token_times.append(now)
                        on_token()
                    if chunk.get("usage"):
                        out.completion_tokens = int(chunk["usage"]["completion_tokens"])
                except (ValueError, TypeError, KeyError, AttributeError):
                    out.error = f"a stream chunk is not an OpenAI completion chunk: {data[:80]!r}"
                    return out
            out.error = "the stream ended without its [DONE]"
    except httpx.TimeoutException as e:
        out.error, out.timed_out = timeout_text(e, answered, bool(out.token_times)), True
    except httpx.HTTPError as e:  # refused, reset, closed mid-stream
        out.error = f"connection lost: {_first_line(e)}"
    return out


def timeout_text(e, answered: bool, streaming: bool) -> str:
    """What a streamed completion waited for in vain, and how long."""
    import httpx

    if isinstance(e, httpx.ConnectTimeout):
        return f"could not connect within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(e, httpx.PoolTimeout):
        return f"no free connection within {READ_TIMEOUT_S:g} s"
    if isinstance(e, httpx.WriteTimeout):
        return f"could not send the request within {READ_TIMEOUT_S:g} s"
    if not answered:
        return f"no answer to POST /v1/completions (not even its status) within {READ_TIMEOUT_S:g} s"
    if not streaming:
        return f"no first token within {READ_TIMEOUT_S:g} s of the answer's start"
    return f"no chunk for {READ_TIMEOUT_S:g} s after the last"


async def event_lines(response):
    """The stream's lines, ended at LF (or CRLF) as a server-sent event's are, and as vLLM's benchmark
    reads them. Not httpx's aiter_lines: that splits as str.splitlines does, also at U+0085, U+2028
    and U+2029, which a server's JSON may hold raw in a token's text, and the chunk would be cut in two."""
    tail = ""
    async for text in response.aiter_text():
        *lines, tail = (tail + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if tail:
        yield tail


# --- a run ---------------------------------------------------------------------------------------
async def send_all(client, bodies: list[dict], times: list[float], concurrency: int,
                   progress: Callable[[int, int], None] | None = None,
                   start: float | None = None) -> tuple[list[Outcome], float, float, float]:
    """Every body sent at its arrival time (seconds after `start`, default now), at most `concurrency`
    open at once: the outcomes in order, the start and the end (perf_counter), and this process's CPU
    seconds."""
    gate = asyncio.Semaphore(concurrency)
    received = finished = 0
    start, cpu = time.perf_counter() if start is None else start, time.process_time()

    def on_token():
        nonlocal received
        received += 1

    async def one(body: dict, due: float) -> Outcome:
        nonlocal finished
        await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        async with gate:
            out = await stream_completion(client, body, start + due, on_token)
        finished += 1
        return out

    async def report():
        while True:
            progress(received, finished)
            await asyncio.sleep(PROGRESS_EVERY_S)

    reporter = asyncio.create_task(report()) if progress else None
    try:
        outcomes = await asyncio.gather(*(one(b, t) for b, t in zip(bodies, times)))
    finally:
        if reporter:
            reporter.cancel()
    end, cpu = time.perf_counter(), time.process_time() - cpu
    if progress:
        progress(received, finished)
    return outcomes, start, end, cpu


def shares(concurrency: int) -> list[int]:
    """The streams each client process opens at most: one process up to STREAMS_PER_PROCESS, else
    as few as hold them, evenly."""
    k = math.ceil(concurrency / STREAMS_PER_PROCESS)
    return [concurrency // k + (i < concurrency % k) for i in range(k)]


async def send_spread(url: str, api_key: str | None, bodies: list[dict], times: list[float], concurrency: int,
                      progress: Callable[[int, int], None] | None = None) -> tuple[list[Outcome], float, float, float]:
    """send_all in one forked process per share of the streams, request i in process i % k, all from
    one start (perf_counter is the system's monotonic clock, the same in every process): the outcomes
    in order, the start, the last end, and the busiest process's CPU seconds."""
    k = len(parts := shares(concurrency))
    context = multiprocessing.get_context("fork")  # (spawn would import the command line's main module again)
    workers = []
    try:
        for i, share in enumerate(parts):
            here, there = context.Pipe()
            process = context.Process(target=_client_process, daemon=True,
                                      args=(there, url, api_key, bodies[i::k], times[i::k], share))
            process.start()
            there.close()
            workers.append((process, here))
        for _, conn in workers:
            _expect(conn, "ready")
        start = time.perf_counter()
        for _, conn in workers:
            conn.send(start)
        results, counts = [None] * k, [(0, 0)] * k
        while None in results:
            for i, (_, conn) in enumerate(workers):
                while results[i] is None and conn.poll():
                    message = _expect(conn, "progress", "done")
                    if message[0] == "progress":
                        counts[i] = message[1:]
                    else:
                        results[i] = message[1:]
            if progress:
                progress(sum(c[0] for c in counts), sum(c[1] for c in counts))
            await asyncio.sleep(PROGRESS_EVERY_S / 5)  # (the figures are the processes' own times)
    finally:
        for process, conn in workers:
            process.kill()
            process.join()
            conn.close()
    outcomes = [None] * len(bodies)
    for i, (outs, _, _) in enumerate(results):
        outcomes[i::k] = outs
    return outcomes, start, max(end for _, end, _ in results), max(cpu for _, _, cpu in results)


async def open_connections(client, n: int) -> None:
    """`n` connections opened (and kept alive in the pool) before the clock starts, by as many
    GET /v1/models at once: a client that streams from a server holds its connection, and opening
    64 of them, the client's own work, would otherwise count in the first requests' TTFT."""
    import httpx

    async def one():
        try:
            (await client.get("/v1/models")).raise_for_status()
        except httpx.HTTPError:  # a failure shows in the timed requests themselves
            pass

    await asyncio.gather(*(one() for _ in range(n)))


def _expect(conn, *kinds: str) -> tuple:
    """The next message of a client process, one of `kinds`; its failure as a RunError."""
    try:
        message = conn.recv() if conn.poll(60) else ("failed", "it did not start within 60 s")
    except EOFError:
        message = ("failed", "it ended unexpectedly")
    if message[0] not in kinds:
        raise RunError(f"a client process failed: {message[1]}")
    return message


def _client_process(conn, url: str, api_key: str | None, bodies: list[dict], times: list[float],
                    concurrency: int) -> None:
    """One forked client: ready, then its requests from the start it is sent; what happened, as messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it ends these)

    async def main():
        client = _client(url, api_key, concurrency)
        await open_connections(client, concurrency)
        conn.send(("ready",))
        start = conn.recv()
        outcomes, _, end, cpu = await send_all(client, bodies, times, concurrency,
                                               lambda received, finished: conn.send(("progress", received, finished)),
                                               start)
        await client.aclose()
        conn.send(("done", outcomes, end, cpu))

    try:
        asyncio.run(main())
    except BaseException as e:  # said by the parent, as one line
        conn.send(("failed", _first_line(e)))


def figures(outcomes: list[Outcome], elapsed: float) -> dict:
    """tokens/s, requests/s, TTFT and ITL of the requests that succeeded; the failures counted."""
    done = [o for o in outcomes if o.error is None]
    ttft = [o.token_times[0] - o.arrival for o in done if o.token_times]
    itl = [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:])]
    failed = [o for o in outcomes if o.error is not None]
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": sum(o.output_tokens for o in done) / elapsed,
        "output_tokens": sum(o.output_tokens for o in done),
        "completed": len(done),
        "errors": len(failed),
        "first_error": failed[0].error if failed else None,
        "ttft_ms": summarize(ttft),
        "itl_ms": summarize(itl),
    }


@dataclass
class Server:
    """A server made ready for runs: its address, its client, the model asked for, the prompts' source."""

    url: str
    api_key: str | None
    client: object
    model: str
    max_model_len: int | None
    prompts: object  # what measure.requests_for reads (prompt_model)


async def connect(url: str, api_key: str | None, concurrency: int, wanted_model: str | None,
                  notice: Callable[[str], None], with_tokenizer: bool = False) -> Server:
    url = base_url(url)
    client = _client(url, api_key, concurrency)
    try:
        card = pick_model(await served_models(client, url), wanted_model, notice)
        length = card.get("max_model_len")  # vLLM's card says it; OpenAI's does not
        prompts = prompt_model(card["id"], wanted_model, with_tokenizer)
    except BaseException:
        await client.aclose()
        raise
    return Server(url, api_key, client, card["id"], length if isinstance(length, int) else None, prompts)


async def run_batch(server: Server, batch: int, w: Workload, progress=None, notice=lambda _: None) -> dict:
    """The bench's workload for one batch size (`batch` streams at once) sent to the server: the
    figures, in the in-process bench's names where they mean the same."""
    requests = requests_for(server.prompts, w, batch)
    check_lengths(requests, server, w)
    n, asked = len(requests), sum(r.max_tokens for r in requests)
    if progress is not None:
        progress(0, asked, 0)
    # one request first, not timed: what a server does lazily on its first request, and a check that it
    # takes the bench's requests (its prompt reversed: the prefix cache holds none of the workload)
    warm = Request(requests[0].prompt_token_ids[::-1], WARM_UP_TOKENS)
    first = await stream_completion(server.client, completion_body(server.model, warm, w.ignore_eos), 0.0)
    if first.timed_out:
        raise RunError(f"{server.url}/v1/completions, the bench's first request: {first.error}",
                       "is the server stuck? its /health says; try again, or check --url")
    if first.error is not None:
        raise RunError(f"{server.url}/v1/completions refused the bench's request: {first.error}",
                       "--url must name an OpenAI-compatible server that takes token ids as the prompt")
    bodies = [completion_body(server.model, r, w.ignore_eos) for r in requests]
    times = arrival_times(n, w.request_rate, w.seed)
    told = progress and (lambda received, finished: progress(received, asked, finished))
    if len(shares(batch)) == 1 or "fork" not in multiprocessing.get_all_start_methods():  # (Windows: one process)
        await open_connections(server.client, batch)
        outcomes, start, end, cpu = await send_all(server.client, bodies, times, batch, told)
    else:
        outcomes, start, end, cpu = await send_spread(server.url, server.api_key, bodies, times, batch, told)
    result = {"batch": batch, "num_prompts": n,
              "input_len": w.input_len if w.prompt_file is None else "file", "output_len": w.output_len,
              "request_rate": None if math.isinf(w.request_rate) else w.request_rate,  # as the in-process bench's
              **figures(outcomes, end - start), "client_cpu_fraction": cpu / (end - start),  # the busiest process's
              "model": server.model, "url": server.url}
    if result["errors"] == n:
        raise RunError(f"every request failed, the first: {result['first_error']}")
    if result["errors"]:
        notice(f"batch {batch}: {result['errors']} of {plural(n, 'request')} failed (left out of the figures), "
               f"the first: {result['first_error']}")
    if result["client_cpu_fraction"] > CLIENT_BUSY:
        notice(f"batch {batch}: a client process was busy {result['client_cpu_fraction']:.0%} of the run: the figures may be "
               "its limit, not the server's (docs/bench-url.md)")
    short = sum(r.max_tokens for r in requests) - result["output_tokens"]
    if w.ignore_eos and not result["errors"] and short > 0:
        notice(f"batch {batch}: the answers held {plural(short, 'token')} fewer than asked: the server does not "
               "honour ignore_eos or min_tokens")
    return result


def check_lengths(requests: list[Request], server: Server, w: Workload) -> None:
    """Refuse, before any request, a workload longer than the server says it takes."""
    if server.max_model_len is None:
        return
    total = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    if total > server.max_model_len:
        prompt = "a --prompt-file prompt" if w.prompt_file is not None else f"--input-len {w.input_len}"
        raise UsageError(f"{prompt} and --output-len {w.output_len} make requests of up to {plural(total, 'token')}, "
                         f"more than the {server.max_model_len} the server takes (its /v1/models)",
                         "shorten them, or serve a longer --max-model-len")


def run(url: str, api_key: str | None, batches: list[int], w: Workload, wanted_model: str | None,
        progress_for: Callable[[int], Callable] | None = None, notice=lambda _: None,
        each: Callable[[dict], None] = lambda _: None) -> list[dict]:
    """The workload at each batch size, one after another, against the server at `url`; `each` hears
    every batch size's figures as it ends."""

    async def main() -> list[dict]:
        server = await connect(url, api_key, max(batches), wanted_model, notice, w.prompt_file is not None)
        results = []
        try:
            for batch in batches:
                results.append(await run_batch(server, batch, w, progress_for and progress_for(batch), notice))
                each(results[-1])
        finally:
            await server.client.aclose()
        return results

    return asyncio.run(main())
