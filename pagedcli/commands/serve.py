"""`pagedcli serve`: the model over HTTP with OpenAI's API, one engine for every client
(pagedcli/serve/ does the work; this is options, messages and the server's start and end). The
engine runs in a process of its own (serve/engine_process.py), this one serves HTTP.

SIGINT, SIGTERM or SIGHUP stop it cleanly: no new connections, the requests in flight get GRACE_S to
finish and are aborted after that, the engine gives every block back, exit code 0.

With --api-server-count N (vLLM's option), N - 1 more API processes serve the same socket, each
with its own link to the one engine (the kernel hands each new connection to one of them): the
HTTP side's Python work, a core's worth at some 30k streamed tokens a second, spreads over N cores.
This process forwards the signal that stops it to them, waits for them, then stops the engine."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Annotated, Optional

import typer
from rich.console import Console

from pagedcli.commands.exits import friendly_errors, notice
from pagedcli.commands.generate import load_for_text, request_params, sampling_defaults
from pagedcli.commands.options import EngineFlags, RequestFlags, flag_group
from pagedcli.core.errors import PagedCliError, RunError, UsageError, plural
from pagedcli.core.heap import frozen_heap
from pagedcli.core.signals import signals_handled
from pagedcli.serve import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING,
    ENGINE_TIMEOUT_S,
    LOG_FORMAT,
    STOP_SIGNALS,
    ignore_stop_signals,
    stop_signals_ignored,
)

GRACE_S = 10.0  # seconds the requests in flight get to finish once a signal stops the server
CLOSE_S = 5.0  # then, after they are aborted, seconds their handlers get to write their endings
# what stops the other API processes (--api-server-count): this one sends it them for each signal it
# gets, and its death does (PR_SET_PDEATHSIG); they ignore the STOP_SIGNALS, which a terminal or a
# service manager (systemd's stop) sends every process of the group, so that each signal counts once
STOP_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGTERM)  # (Windows has none: --api-server-count needs Linux)
# and the first's death (PR_SET_PDEATHSIG): the kernel signals it as each thread of the first that
# holds them in turn ends (a SIGKILL: often twice), so it never counts as a second signal
PARENT_GONE = getattr(signal, "SIGUSR2", None)
# RequestFlags that a request gives itself (its prompt, chat or not, n, logprobs); the rest are the
# defaults for what a request leaves out
PER_REQUEST = {"prompts": None, "prompt_file": None, "prompt_separator": r"\n", "chat": None, "system": None,
               "samples": 1, "logprobs": None, "json_schema": None, "regex": None, "choice": None, "grammar": None}


@friendly_errors
@flag_group(RequestFlags, "requests", leave_out=PER_REQUEST)
@flag_group(EngineFlags, "engine_flags")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one, said at start).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        help="Ask every /v1 request for this key (`Authorization: Bearer KEY`).", show_default=False)] = None,
    max_waiting: Annotated[int, typer.Option(
        help="Answers waiting for a slot (n a request), at most; the next request gets HTTP 429.")] = DEFAULT_MAX_WAITING,
    live: Annotated[bool, typer.Option("--live", help="Watch the KV cache under the server's traffic, the access "
                                       "log above it (on a terminal only).")] = False,
    api_server_count: Annotated[int, typer.Option(
        help="API processes serving HTTP for the one engine (more when one core cannot keep up with the tokens), "
        "at most one a CPU core.")] = 1,
    max_request_size: Annotated[str, typer.Option(
        help="The largest request body taken, e.g. 8MiB; a larger one gets HTTP 413 before it is read.")]
        = f"{DEFAULT_MAX_BODY_BYTES >> 20}MiB",
    engine_timeout: Annotated[float, typer.Option(
        help="Seconds the engine process may say nothing (not a step, not its heartbeat every second) before "
        "/health answers 503 and the requests in it end with an error (vLLM's 60 s).")] = ENGINE_TIMEOUT_S,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        help="How the model writes tool calls: hermes (<tool_call> tags: Hermes, Qwen) or llama3_json (Llama 3.1, "
        "3.2). Default: hermes if the chat template speaks of <tool_call>, else llama3_json.",
        show_default=False)] = None,
    *, requests: RequestFlags, engine_flags: EngineFlags,
):
    """Serve the model with OpenAI's API (completions and chat, streamed or not) to many clients at once."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        from pagedcli.serve import INSTALL_HINT, MISSING, REINSTALL_HINT

        if e.name in ("fastapi", "uvicorn"):
            raise RunError(MISSING, INSTALL_HINT) from None
        # installed, but broken: one of their own dependencies missing (a partial install), or worse
        raise RunError(f"{MISSING}, which did not import: {str(e).splitlines()[0]}", REINSTALL_HINT) from None
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: not a port", "use 1 to 65535, or 0 for any free one")
    if max_waiting < 1:
        raise UsageError(f"--max-waiting {max_waiting}: must be at least 1")
    if api_server_count < 1:
        raise UsageError(f"--api-server-count {api_server_count}: must be at least 1")
    cores = os.cpu_count() or 1
    if api_server_count > cores:  # (each is a process with its own interpreter: more than the cores only cost memory)
        raise UsageError(f"--api-server-count {api_server_count}: more API processes than this machine's "
                         f"{plural(cores, 'CPU core')}", f"use at most {cores}")
    from pagedcli.core.geometry import parse_size

    try:
        max_body_bytes = parse_size(max_request_size)
    except UsageError:
        raise UsageError(f"--max-request-size {max_request_size!r} is not a size", "write it like 8MiB or 100MB") from None
    if tool_call_parser is not None and tool_call_parser not in ("hermes", "llama3_json"):  # (serve/tools.py's)
        raise UsageError(f"--tool-call-parser {tool_call_parser!r} is not known", "use hermes or llama3_json")
    if not (math.isfinite(engine_timeout) and engine_timeout > 0):  # (NaN fails it too)
        raise UsageError(f"--engine-timeout {engine_timeout}: must be a positive number of seconds",
                         f"leave it out for {ENGINE_TIMEOUT_S:g}")
    if live and api_server_count > 1:
        raise UsageError("--live draws one API process's log above its frame", "leave out --api-server-count, or --live")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty", "give a key, or leave the option out")
    params, given = request_params(requests)  # the options' mistakes before the model loads
    if api_server_count > 1 and not (sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")):
        raise UsageError("--api-server-count needs Linux (its SO_REUSEPORT spreads the connections over the processes)")
    sock = bind(host, port, share=api_server_count > 1)
    if api_key is None and not is_loopback(host):
        notice(f"warning: --host {host} serves anyone who can reach it, and without --api-key nothing is asked of them")

    from pagedcli.serve.app import Settings, create_app
    from pagedcli.serve.engine_client import EngineClient
    from pagedcli.serve.metrics import Metrics

    if live and not Console(file=sys.stdout).is_terminal:
        notice("--live: stdout is not a terminal, so no live view")
        live = False
    metrics = Metrics()
    engine = EngineClient(load_model, (engine_flags, requests), metrics, live)
    shared = None  # with the live view: where this process's lines go (above its frame, drawn by the engine's process)
    others = []  # the other API processes
    server = None
    try:
        ready = engine.start(api_server_count)
        if live:
            from pagedcli.serve.live import ToView

            shared = ToView(engine.log)
        name = ready.model_name
        defaults = sampling_defaults(params, ready.generation_config, given, f"{name}'s generation_config.json")
        settings = Settings(name, defaults, api_key, max_waiting, max_body_bytes, engine_timeout, tool_call_parser)
        bound_host, bound_port = sock.getsockname()[:2]
        others = [start_api_process(link, (bound_host, bound_port), settings) for link in engine.other_links]
        wait_for_api_processes(others)
        app = create_app(engine, ready, settings, metrics)
        config = server_config(app, use_colors=False if shared is not None else None)
        quiet_startup(shared)
        processes = f", {api_server_count} API processes" if api_server_count > 1 else ""
        line = (f"serving {name} at http://{url_host(bound_host)}:{bound_port}/v1 with OpenAI's API "
                f"({plural(ready.max_slots, 'slot')}{processes}; Ctrl-C stops)")
        server = make_server(config, engine, on_signal=lambda: [forward_stop(p) for p in others],
                             on_started=lambda: say(line, shared))
        server.run(sockets=[sock])
    finally:
        # they stop on their own, forwarded the signal that stopped this one (a second one now
        # would end what they still run before their grace is out), or are told here
        if server is None or server.stopped_by is None:
            for process in others:
                forward_stop(process)
        # a signal while they finish (a second Ctrl-C) goes on to them too: it ends what they run
        forwarded = STOP_SIGNALS if others else ()
        with signals_handled(forwarded, lambda *_: [forward_stop(p) for p in others]):
            for process in others:
                deadline = time.monotonic() + GRACE_S + CLOSE_S + 5
                # this one's link is read meanwhile: the others' answers count in its summary, and
                # the engine never waits on its full pipe (nor the others' streams on the engine)
                while process.is_alive() and time.monotonic() < deadline and engine.take_a_message():
                    pass
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
        engine.stop()
        sock.close()
    by = f" by {signal.Signals(server.stopped_by).name}" if server.stopped_by else ""
    notice(f"stopped{by}: {metrics.summary()}")  # (the live view has left the screen)


def server_config(app, use_colors=None):
    import uvicorn

    return uvicorn.Config(app, log_level="info", log_config=log_config(), lifespan="off",
                          timeout_graceful_shutdown=GRACE_S + CLOSE_S, use_colors=use_colors)


def start_api_process(link, address: tuple, settings):
    """Another API process (spawned: a fresh interpreter, as the engine's) serving `address` with the
    engine's other end of `link`."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    started = context.Event()
    process = context.Process(target=api_process, name="pagedcli-api", args=(link, address, settings, started))
    process.started = started
    with stop_signals_ignored():  # (what the group gets reaches this one, which forwards it as STOP_SIGNAL)
        process.start()
    for end in link:  # the process holds its own copies now: the engine sees its death as EOF
        end.close()
    return process


def wait_for_api_processes(processes) -> None:
    """Until each serves (so that "serving" is said once every socket takes connections)."""
    deadline = time.monotonic() + 120
    for process in processes:
        while not process.started.wait(0.1):
            if not process.is_alive() or time.monotonic() > deadline:
                raise RunError(f"an API process (--api-server-count) did not start (exit code {process.exitcode})")


def forward_stop(process) -> None:
    if process.pid is not None and process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STOP_SIGNAL)


def api_process(link, address: tuple, settings, started) -> None:
    """An API process of --api-server-count's: the same app on a socket of its own bound to the same
    port, its own link to the engine; it stops on STOP_SIGNAL (the first API process forwards its
    signals) as that one does, and when that one dies (even by SIGKILL: no orphan serves on)."""
    ignore_stop_signals()
    import ctypes

    PR_SET_PDEATHSIG = 1  # Linux's prctl: this signal when the parent is gone
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, PARENT_GONE)
    if os.getppid() == 1:  # (it died before the prctl)
        return
    from pagedcli.serve.app import create_app
    from pagedcli.serve.engine_client import EngineClient
    from pagedcli.serve.metrics import Metrics

    metrics = Metrics()
    engine = EngineClient(None, (), metrics)
    sock = None
    try:
        sock = bind(*address, share=True, join=True)
        ready = engine.join(link)
        config = server_config(create_app(engine, ready, settings, metrics))
        quiet_startup(None)  # (after the config: making it sets uvicorn's loggers up again)
        server = make_server(config, engine, signals=(STOP_SIGNAL, PARENT_GONE), on_started=started.set)
        server.run(sockets=[sock])
    except EOFError:  # the engine was gone before this process started: the first API process says why
        pass
    except PagedCliError as e:  # (the port taken meanwhile): the first API process says it did not start
        notice(str(e))
    finally:
        engine.stop()
        if sock is not None:
            sock.close()


def load_model(engine_flags: EngineFlags, requests: RequestFlags):
    """The model as generate loads it, in the engine's process, with its CUDA graphs captured and the
    server's default step budget; but one without a tokenizer (random weights, for a benchmark
    through the server) is served too, for prompts of token ids."""
    from pagedcli.engine.build import load

    if engine_flags.model is not None and engine_flags.model.startswith("random:"):
        if requests.chat_template is not None:
            raise UsageError("--chat-template: random weights have no tokenizer to render it with")
        loaded = load(engine_flags.options(serving=True), notice)  # (an unknown preset fails before the notice)
        notice(f"--model {engine_flags.model} has no tokenizer: prompts as token ids, answers without text "
               "(count them by usage)")
    else:
        loaded = load_for_text(engine_flags, requests, "serve", None, serving=True)
    capture_graphs(loaded.engine.runner)
    plan_long_prompts(loaded.engine)
    return loaded


def capture_graphs(runner) -> None:
    """Every CUDA graph before the first request, as vLLM's server does: captured on first use,
    each new batch size or prompt bucket would stall every running stream while it is captured,
    and a burst of requests meets a dozen of them (a one-shot generate captures only what it uses)."""
    kinds = {"decode": runner.graphs, "prefill": runner.prefill_graphs}
    counts = {kind: len(graphs.buckets) for kind, graphs in kinds.items() if graphs is not None}
    if not counts:
        return
    started = time.perf_counter()
    runner.capture_graphs()
    notice(f"captured {plural(sum(counts.values()), 'CUDA graph')} "
           f"({' and '.join(f'{n} {kind}' for kind, n in counts.items())}) in {time.perf_counter() - started:.1f} s")


def plan_long_prompts(engine) -> None:
    """cuDNN's plan for every padded length a whole long prompt can take (backends/cudnn_prefill.py)
    before the first request, for the same reason as the graphs: each is made on first use, while
    every running stream waits (docs/performance-log.md, "Prefill")."""
    plan = getattr(engine.runner.model.backend, "plan_whole_prompts", None)
    if plan is None:
        return
    started = time.perf_counter()
    n = plan(min(engine.scheduler.max_num_batched_tokens, engine.cache.max_model_len))
    if n:
        notice(f"planned cuDNN's attention for {plural(n, 'prompt length')} in {time.perf_counter() - started:.1f} s")


def say(text: str, shared) -> None:
    """A notice, or with the live view on, a line above its frame."""
    if shared is not None:
        shared.write(text + "\n")
    else:
        notice(text)


def bind(host: str, port: int, share: bool = False, join: bool = False) -> socket.socket:
    """The listening socket, bound here so that a port in use is one line, before the model loads;
    `share`: other API processes bind the same port (SO_REUSEPORT: the kernel spreads the new
    connections over their sockets; on one shared socket, uvloop's accept loop in whichever process
    woke first took a burst's connections all); `join`: this is one of them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address here ({e.strerror})", "use 127.0.0.1, 0.0.0.0 or ::") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if share:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        if share and not join:  # a socket without SO_REUSEPORT first, which fails where another server's
            # SO_REUSEPORT sockets hold the port (this one's would join them, and take half their connections)
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
                address = probe.getsockname()  # (port 0: the one it got)
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = ("another server may have the port: pick another --port, or 0 for any free one"
                if e.errno == errno.EADDRINUSE else
                "the address is not this machine's: use 127.0.0.1, 0.0.0.0 (every address) or one of its own"
                if e.errno == errno.EADDRNOTAVAIL else None)
        raise RunError(f"--host {host} --port {port}: cannot listen there ({e.strerror})", hint) from None
    sock.listen(2048)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def log_config() -> dict:
    """uvicorn's, with the access log on stderr too: stdout is the live view's, or nobody's."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def quiet_startup(shared) -> None:
    """uvicorn's own start and stop lines say less than ours: only its warnings stay, the access
    log (a line per request) too; with the live view, above its frame."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.setLevel(logging.WARNING)
    if not any(isinstance(f, NoCutTracebacks) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(NoCutTracebacks())
    log = logging.getLogger("pagedcli.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        log.propagate = False
    if shared is not None:
        from pagedcli.serve.live import log_above

        log_above(shared, ("uvicorn", "uvicorn.error", "uvicorn.access", "pagedcli.serve"))


class NoCutTracebacks(logging.Filter):
    """At its shutdown deadline uvicorn cancels the handlers still running (a stream whose client
    stopped reading cannot write its ending) and logs each one's CancelledError as "Exception in
    ASGI application" with a traceback; its own line before them ("Cancel N running task(s),
    timeout graceful shutdown exceeded") says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def make_server(config, engine, on_signal=lambda: None, signals=STOP_SIGNALS,
                on_started=lambda: None):
    """`on_signal`: called at each signal that stops it (the other API processes hear of it);
    `on_started`: once it serves (the first process says so then: a signal from then on is a stop)."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a signal that stops it ends the command with exit code 0 once the
        shutdown is done (uvicorn raises the signal again, which would end it as killed). The
        requests in flight get GRACE_S to finish; then (or at a second signal, at once) the engine
        aborts them, so that each client still gets its answer's ending (an error event and [DONE],
        or a 503) before uvicorn's own deadline, CLOSE_S later, would cut the connections."""

        stopped_by: int | None = None
        grace: threading.Timer | None = None

        def run(self, sockets=None) -> None:
            """With the heap frozen, and the stop signals this server's for the whole run, not only
            serve()'s: the heap's collection before it and the event loop's runner around it (which
            takes SIGINT itself where it finds Python's default) would otherwise end the command
            with 130 at a Ctrl-C, or a forwarded stop with SIGUSR1's default action."""
            try:
                with signals_handled(signals, self.handle_exit), frozen_heap():
                    super().run(sockets=sockets)
            finally:  # done before the grace ran out: the engine is stopped next, not told to abort
                if self.grace is not None:
                    self.grace.cancel()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            engine.attach(asyncio.get_running_loop())  # its messages are read from now on
            on_started()

        @contextlib.contextmanager
        def capture_signals(self):
            yield  # run() holds the handlers (uvicorn's own would raise each signal again at the end)

        def handle_exit(self, sig, frame) -> None:
            on_signal()
            if self.stopped_by is not None:  # a second signal: end what runs now
                if sig != PARENT_GONE:
                    engine.end_all()
                return
            self.stopped_by = sig
            self.grace = threading.Timer(GRACE_S, engine.end_all)
            self.grace.daemon = True
            self.grace.start()
            super().handle_exit(sig, frame)

    return Server(config)
