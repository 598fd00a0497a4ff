"""The API process's side of the engine (which runs in a process of its own, engine_process.py):
start it, send it commands, and hand each request the tokens its answers gained.

A request is a Job: the route submits it (an "add" command through the pipe) and awaits its
deltas. The event loop watches the pipe from the server's start (loop.add_reader): each message
the engine sends after a turn is read there (a large one in as many reads as it takes, without
blocking: MessageReader), and its deltas go to their jobs, each waking its route, so a token
reaches its client as soon as the engine has sampled it.

Commands go down a pipe of their own (command_pipe.py), written from the event loop without ever
blocking it: a blocked send (the pipe full while the engine waits for this process to read its
messages) would stop the loop from reading, and the two processes would wait for each other. The
engine never waits for a client, only for this process, when it falls a pipe's worth behind.

A dead engine process (killed, crashed) closes its end: the reader sees EOF, every open request
ends with an error, and from then on /health and new requests answer 503 at once.

A hung one (stopped with SIGSTOP, stuck in a step) says nothing: every message of the engine's is a
heartbeat (an idle engine sends one each engine_process.HEARTBEAT_S), and once none has come for
`timeout_s` (serve --engine-timeout, vLLM's 60 s iteration timeout) /health and new requests answer
503 and the open requests end with an error (their aborts go down the pipe, for an engine that
wakes up again); the first message after that makes it healthy again."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import select
import struct
import time
from dataclasses import dataclass, field

from pagedcli.core.errors import RunError
from pagedcli.model.tokenizer import StreamDecoder
from pagedcli.serve import ENGINE_TIMEOUT_S, engine_process, stop_signals_ignored
from pagedcli.serve.command_pipe import CommandPipe, frame, widen
from pagedcli.serve.engine_process import Ready
from pagedcli.serve.errors import APIError, server_error
from pagedcli.serve.metrics import Metrics
from pagedcli.serve.sampling import Prompts

log = logging.getLogger("pagedcli.serve")
STOP_S = 10.0  # seconds the engine process gets to end its requests and exit, once told to stop
ENGINE_GONE = "the engine process has stopped; restart the server"
READ_AT_ONCE = 8  # engine messages read in one go before the event loop runs the routes again
WATCH_EVERY_S = 1.0  # how often the event loop looks at the engine's silence


@dataclass(slots=True)
class Delta:
    """What one answer gained: in one engine turn, or since the client's last read (Job.receive)."""

    index: int  # the answer's place in the request (prompt i's answer j: i * n + j)
    token_ids: list[int]
    text: str | None  # None: not decoded yet (Job.receive decodes); an answer with stop strings
    # comes with the engine's text, cut before the stop string
    logprobs: list = field(default_factory=list)  # TokenLogprobs, one per new token, when asked for
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while it runs
    error: str | None = None
    prompt_logprobs: list | None = None  # the prompt's (None, then a TokenLogprobs a token), once, when asked for

    def extend(self, later: Delta) -> None:
        self.token_ids += later.token_ids
        self.text = None if self.text is None or later.text is None else self.text + later.text
        self.logprobs += later.logprobs
        self.finish_reason, self.error = later.finish_reason, later.error
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


class ClientGone(Exception):
    """The request's client closed its connection: nobody reads what its answers gain."""


class Job:
    """One HTTP request in the engine: its prompts, and what its answers gained that its route has
    not taken yet. Its text is decoded here, once per read, not per token in the engine's process."""

    def __init__(self, request_id: str, prompts: Prompts, tokenizer):
        self.request_id = request_id
        self.prompts = prompts
        self.arrival = time.perf_counter()
        self.key = 0  # its number in the pipe's messages (EngineClient.submit)
        self.pending: dict[int, Delta] = {}  # answer index -> what it gained since the last receive
        self.waiter: asyncio.Future | None = None  # the route's receive, while nothing is pending
        self.num_open = prompts.num_answers  # answers whose last delta has not been received
        self.ended: set[int] = set()  # answers whose last delta has been delivered
        answers = [ids for ids, params in zip(prompts.token_ids, prompts.params) for _ in params]
        # (a model without a tokenizer, random weights for a benchmark, answers token ids only: no text)
        self.decoders = [StreamDecoder(tokenizer, ids) if tokenizer is not None else None for ids in answers]
        self.outputs: list[list[int]] = [[] for _ in answers]  # each answer's tokens received so far
        self.gone = False  # its client has closed the connection (hang_up)

    @property
    def done(self) -> bool:
        """Every answer's last delta has been received."""
        return self.num_open == 0

    def deliver(self, delta: Delta) -> None:
        """What an answer gained in one engine turn (in the event loop). A route that has not read
        the turns before gets them merged into one delta: the engine never waits for a client."""
        if (earlier := self.pending.get(delta.index)) is not None:
            earlier.extend(delta)
        else:
            self.pending[delta.index] = delta
        self._wake()

    def deliver_token(self, index: int, token: int) -> None:
        """deliver() for the common case: answer `index` gained one token, and nothing else."""
        if (earlier := self.pending.get(index)) is not None:
            earlier.token_ids.append(token)
        else:
            self.pending[index] = Delta(index, [token], None)
        self._wake()

    def hang_up(self) -> None:
        """The client went away: the route's receive raises ClientGone (its stream ends, the job is aborted)."""
        self.gone = True
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def receive(self) -> list[Delta]:
        """What the answers gained since the last call, a delta per answer that gained anything;
        waits for the engine's next turn when nothing is pending. ClientGone once the client has gone."""
        while not self.pending or self.gone:
            if self.gone:
                raise ClientGone
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        deltas, self.pending = list(self.pending.values()), {}
        for d in deltas:
            self.outputs[d.index] += d.token_ids
            if d.text is None:
                decoder = self.decoders[d.index]
                d.text = decoder.catch_up_at_once(self.outputs[d.index]) if decoder is not None else ""
            self.num_open -= d.finish_reason is not None
        return deltas


class EngineClient:
    def __init__(self, build, args: tuple, metrics: Metrics, live: bool = False):
        """The engine process builds its engine with `build(*args)`, a module-level function
        (spawn pickles it by name); `live`: it draws the live view."""
        self.build, self.args, self.live = build, args, live
        self.metrics = metrics
        self.conn = None  # the engine's messages
        self.reader: MessageReader | None = None  # reads them without blocking, once the loop watches them
        self.commands: CommandPipe | None = None
        self.process = None  # the engine's, when this process started it (the first API process)
        self.other_links: list[tuple] = []  # for the other API processes (--api-server-count), until handed out
        self.ready = False  # the engine process has built the engine and reads commands
        self.loop: asyncio.AbstractEventLoop | None = None
        self.jobs: dict[int, Job] = {}  # key -> the job, until its answers have all ended
        self.snapshots: dict[int, asyncio.Future] = {}
        self.keys = itertools.count(1)
        self.gone = False  # the engine process's end of the pipe closed
        self.pending: select.poll | None = None  # whether a message of the engine's waits (set with the loop)
        self.num_sent = 0  # answers submitted so far
        self.num_taken = 0  # of those, taken out of the pipe by the engine, as of its last message
        self.num_engine_waiting = 0  # answers waiting in the engine after its last turn
        self.num_free_slots = 0  # slots no answer held after its last turn
        self.timeout_s = ENGINE_TIMEOUT_S  # (the app sets the server's)
        self.last_heard = time.monotonic()  # when the engine's last message was read
        self.hung = False  # silent for longer than timeout_s, as of the last look

    # --- start and end ------------------------------------------------------------------------------
    def start(self, num_api_processes: int = 1) -> Ready:
        """Start the engine process and wait until it has built the engine; raise here what
        building it raised there (a UsageError, say). With more API processes than this one, the
        links for the others (`other_links`: each a pair of pipe ends, for `join`) are made too."""
        context = multiprocessing.get_context("spawn")  # never fork: CUDA does not survive a fork
        here, there = [], []
        for _ in range(num_api_processes):
            messages_in, messages_out = context.Pipe(duplex=False)  # the engine's messages
            widen(messages_in.fileno())
            commands_in, commands_out = context.Pipe(duplex=False)
            here.append((messages_in, commands_out))
            there.append((messages_out, commands_in))
        self.process = context.Process(target=engine_process.main, name="pagedcli-engine",
                                       args=(there, self.build, self.args, self.live))
        with stop_signals_ignored():
            self.process.start()
        for ends in there:  # the engine process's ends, which it alone holds now: its death is EOF here
            for end in ends:
                end.close()
        self.other_links = here[1:]
        try:
            return self.join(here[0])
        except EOFError:
            self.process.join()
            raise RunError(f"the engine process ended while it built the engine (exit code {self.process.exitcode})") \
                from None

    def join(self, link: tuple) -> Ready:
        """Take `link` (the engine's messages in, the commands out) and its engine's Ready (another
        API process's client does only this: the engine process is the first one's)."""
        self.conn, commands_out = link
        self.commands = CommandPipe(commands_out)
        kind, what = self.conn.recv()
        if kind == "failed":
            if self.process is not None:
                self.process.join()
            raise what
        self.metrics.describe(what.model_name, what.geometry.num_blocks)
        self.num_free_slots = what.max_slots
        self.ready = True
        self.last_heard = time.monotonic()
        return what

    def stop(self) -> None:
        """Abort what still runs, let the engine process end and wait for it (idempotent). One
        still building reads no command: it is killed at once. Another API process's client (no
        engine process of its own) says stop and reads until the engine lets its link go."""
        owner = self.process is not None
        if owner and self.process.pid is None:
            return
        try:
            if self.ready and not self.gone and not self.conn.closed and (not owner or self.process.is_alive()):
                deadline = time.monotonic() + STOP_S
                # (what the engine still sends is read meanwhile: a send of its to a full pipe would
                # keep it from reading the stop)
                self.commands.write_blocking(frame(("stop",)), deadline, self.take_a_message)
                while time.monotonic() < deadline and self.take_a_message():  # until it lets the link go
                    pass
                if owner:
                    self.process.join(max(0.0, deadline - time.monotonic()))
        finally:  # (a second Ctrl-C in the wait above must not leave the engine process behind)
            if owner:
                if self.process.is_alive():  # still building, or stuck: it holds GPU memory, so it goes
                    self.process.kill()
                self.process.join()
            self._close_pipes()

    def _close_pipes(self) -> None:
        if self.loop is not None and not self.loop.is_closed() and not self.gone and not self.conn.closed:
            self.loop.remove_reader(self.conn.fileno())
        if self.commands is not None:
            self.commands.close()
        if self.conn is not None:
            self.conn.close()

    def take_a_message(self) -> bool:
        """Read one message of the engine's, if one comes within 50 ms, its report counted (the
        server has stopped serving: its summary line still counts what ends meanwhile); False once
        the engine's end has closed."""
        try:
            if self.conn.poll(0.05):
                message = self.conn.recv() if self.reader is None else self.reader.next()
                if message is not None and message[0] == "step":
                    self.metrics.record(message[3])
            return True
        except (EOFError, OSError):
            return False

    @property
    def alive(self) -> bool:
        return not self.gone and (self.process is None or self.process.is_alive())

    def silence(self) -> float | None:
        """Seconds the engine has been silent, when that is longer than `timeout_s` (it hangs); else
        None. Its messages waiting in the pipe are read first: a busy event loop is no hung engine."""
        silent = time.monotonic() - self.last_heard
        if silent > self.timeout_s and self.loop is not None and not self.gone and self.pending.poll(0):
            self._read()
            silent = time.monotonic() - self.last_heard
        return silent if silent > self.timeout_s else None

    def _watch(self) -> None:
        """Every WATCH_EVERY_S in the event loop: an engine silent past `timeout_s` is hung. Its open
        requests end with an error now (nothing would end them), and it is said once in the log."""
        if self.gone or self.loop is None or self.loop.is_closed():
            return
        self.loop.call_later(WATCH_EVERY_S, self._watch)
        silent = self.silence()
        if silent is None:
            if self.hung:
                log.warning("the engine process answers again")
            self.hung = False
            return
        if not self.hung:
            log.error("the engine process has not answered for %.0f s (--engine-timeout): /health answers 503 "
                      "until it does", silent)
        self.hung = True
        why = hung_message(silent)
        for job in list(self.jobs.values()):
            for i in range(job.prompts.num_answers):
                if i not in job.ended:
                    job.deliver(Delta(i, [], "", [], "abort", why))
                    job.ended.add(i)
            self.abort(job)
        for future in self.snapshots.values():
            if not future.done():
                future.set_exception(APIError(why, 503, type="server_error"))
        self.snapshots.clear()

    # --- commands (from the event loop; end_all and log from any thread) ----------------------------
    @property
    def num_waiting(self) -> int:
        """Answers that wait for a slot: in the engine's waiting queue, and those on their way to it
        that its free slots will not take."""
        return self.waiting_with(0)

    def waiting_with(self, answers: int) -> int:
        """num_waiting once `answers` more are sent (those the free slots will not take wait too)."""
        return self.num_engine_waiting + max(0, self.num_sent + answers - self.num_taken - self.num_free_slots)

    def submit(self, job: Job) -> None:
        self._check_alive()
        job.key = next(self.keys)
        self.jobs[job.key] = job
        self.num_sent += job.prompts.num_answers
        self.commands.send(("add", job.key, job.request_id, job.arrival, job.prompts))

    def abort(self, job: Job) -> None:
        """The client went away: its answers end now and their blocks go back."""
        if self.jobs.pop(job.key, None) is not None and not self.gone:
            self.commands.send(("abort", job.key))

    async def snapshot(self):
        """The cache as the engine has it between two steps (engine/snapshot.py)."""
        self._check_alive()
        key = next(self.keys)
        future = self.snapshots[key] = asyncio.get_running_loop().create_future()
        self.commands.send(("snapshot", key))
        return await future

    def end_all(self) -> None:
        """Every answer still open ends now ("abort": the server is shutting down)."""
        self.commands.send(("end_all",))

    def log(self, text: str) -> None:
        """A line for the live view, printed above its frame."""
        self.commands.send(("log", text))

    def _check_alive(self) -> None:
        """A command for a process that is gone would wait for ever: 503 at once instead. (Its
        death closes the pipe, which the loop, reading it since the server started, sees as EOF:
        `gone`, without a waitpid per request.)"""
        if self.gone:
            raise APIError(ENGINE_GONE, 503, type="server_error")
        if self.ready and (silent := self.silence()) is not None:
            raise APIError(hung_message(silent), 503, type="server_error")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """`loop` (uvicorn's, at the server's start: commands/serve.py make_server) reads the
        engine's messages from now on: before any request, so that an engine that dies is seen at
        once, and every turn's report is read (several API processes each get all of them; unread,
        they would fill the pipe and stop the engine)."""
        if self.loop is None:
            self.loop = loop
            self.pending = select.poll()  # (Connection.poll builds a selector each call: a tenth of _read's time)
            self.pending.register(self.conn.fileno(), select.POLLIN)
            self.reader = MessageReader(self.conn.fileno())
            self.loop.add_reader(self.conn.fileno(), self._read)
            self.commands.attach(self.loop)
            self.loop.call_later(WATCH_EVERY_S, self._watch)

    # --- the engine's messages (in the event loop) --------------------------------------------------
    def _read(self) -> None:
        """The messages waiting, a few at most: the routes' writes then run before the next ones
        (the fd is still readable, so the loop calls this again), and a lagging client's deltas merge."""
        try:
            for _ in range(READ_AT_ONCE):
                if (message := self.reader.next()) is None:  # (not all of it has come: the loop calls again)
                    break
                self.last_heard = time.monotonic()
                if message[0] == "step":
                    self._deliver(*message[1:])
                elif message[0] == "snapshot":
                    self._snapshot_taken(*message[1:])  # (else a heartbeat: heard)
        except (EOFError, OSError):
            self._engine_gone()

    def _deliver(self, tokens, deltas: list[tuple], report) -> None:
        """One engine turn's message: `tokens` (key, index, token) flat, the answers that gained one
        token and nothing else; `deltas` the rest (engine_process.py)."""
        jobs = self.jobs
        triples = iter(tokens)
        for key, index, token in zip(triples, triples, triples):
            if (job := jobs.get(key)) is not None:  # (None: aborted here already)
                job.deliver_token(index, token)
        for key, index, *rest in deltas:
            job = jobs.get(key)
            if job is None or index in job.ended:  # aborted here already
                continue
            delta = Delta(index, *rest)
            job.deliver(delta)
            if delta.finish_reason is not None:
                job.ended.add(index)
                if len(job.ended) == job.prompts.num_answers:
                    del jobs[key]
        self.num_taken, self.num_engine_waiting = report.num_taken, report.waiting
        self.num_free_slots = report.free_slots
        self.metrics.record(report)

    def _snapshot_taken(self, key: int, snap, error: str | None) -> None:
        future = self.snapshots.pop(key, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(server_error(f"the snapshot failed: {error}"))
        else:
            future.set_result(snap)

    def _engine_gone(self) -> None:
        """Every open request ends with an error (a 503's reason: the server needs a restart)."""
        if self.gone:
            return
        self.gone = True
        self.loop.remove_reader(self.conn.fileno())
        code = ""  # (another API process's client did not start the engine process: no exit code to tell)
        if self.process is not None:
            self.process.join(1)
            code = f" (exit code {self.process.exitcode})"
        log.error("the engine process ended%s: every request gets 503 now", code)
        for job in self.jobs.values():  # ("abort": a 503, as when the server stops)
            for i in range(job.prompts.num_answers):
                if i not in job.ended:
                    job.deliver(Delta(i, [], "", [], "abort", ENGINE_GONE))
        self.jobs.clear()
        for future in self.snapshots.values():
            if not future.done():
                future.set_exception(APIError(ENGINE_GONE, 503, type="server_error"))
        self.snapshots.clear()


class MessageReader:
    """The engine's messages, framed as multiprocessing's Connection frames them (a 4-byte size, or
    -1 and an 8-byte one, then the pickle), read from the pipe without ever blocking: a message of
    which only a part has come (one larger than the pipe holds, or one the engine is still writing)
    waits here for the rest. (Connection.recv cannot: uvloop makes every fd it watches non-blocking,
    and a recv in the middle of such a message raised BlockingIOError, which read as the engine's
    death: a 500-token prompt's log-probabilities did it.)"""

    LONG = b"\xff\xff\xff\xff"  # a size of -1: the real one follows in 8 bytes

    def __init__(self, fd: int):
        os.set_blocking(fd, False)  # (the stdlib's loop leaves it blocking: the same reads on both)
        self.fd = fd
        self.head = bytearray()
        self.body: bytearray | None = None  # once the size is known
        self.size = 0

    def next(self):
        """The next whole message, or None while it has not all come; EOFError once the pipe has closed."""
        while True:
            if self.body is None:
                need = 12 if self.head[:4] == self.LONG else 4
                if len(self.head) == need:
                    self.size = struct.unpack("!i", self.head)[0] if need == 4 else struct.unpack("!Q", self.head[4:])[0]
                    if need == 4 and self.size == -1:
                        continue
                    self.head.clear()
                    self.body = bytearray()
                    continue
                piece = self._read(need - len(self.head))
                if piece is None:
                    return None
                self.head += piece
            elif len(self.body) == self.size:
                body, self.body = self.body, None
                return pickle.loads(body)
            else:
                piece = self._read(self.size - len(self.body))
                if piece is None:
                    return None
                self.body += piece

    def _read(self, n: int) -> bytes | None:
        try:
            piece = os.read(self.fd, n)
        except (BlockingIOError, InterruptedError):
            return None
        if not piece:
            raise EOFError
        return piece


def hung_message(silent: float) -> str:
    return (f"the engine process has not answered for {silent:.0f} s (--engine-timeout); "
            "try again later, or restart the server")
