"""One engine for every client: it steps in a thread of its own, and requests join its batch.

The event loop (the HTTP side) never touches the engine. It puts commands in a thread-safe inbox
(add a request, abort one, take a snapshot, stop); the engine thread takes them between steps,
calls engine.step() while anything is unfinished, and after each step hands every request the
tokens its answers gained, with their text and log-probabilities, in one call into the event loop
(call_soon_threadsafe). So a token reaches its client as soon as it is sampled, new requests join
the running batch at the next step (continuous batching), and the engine's own loop is the one
`pagedcli generate` runs: the GPU overlap (engine.py) works as there, no step waits for HTTP.

The engine is built in this thread too, so everything thread-bound on a GPU (torch's current
stream, CuPy's current device, CUDA graphs) belongs to the thread that steps."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pagedcli.engine.sequence import Sequence
from pagedcli.errors import allocation_failure
from pagedcli.model.tokenizer import StreamDecoder
from pagedcli.serve.errors import APIError
from pagedcli.serve.metrics import Metrics
from pagedcli.serve.sampling import Prompts

log = logging.getLogger("pagedcli.serve")
IDLE_TICK_S = 0.2  # an idle engine thread wakes this often only when a live view wants frames


@dataclass
class Delta:
    """What one answer gained: in one step (from the engine thread), or since the client's last
    read (Job.receive)."""

    index: int  # the answer's place in the request (prompt i's answer j: i * n + j)
    token_ids: list[int]
    text: str | None  # None: not decoded yet (Job.receive decodes); an answer with stop strings
    # comes with the engine's text, cut before the stop string
    logprobs: list = field(default_factory=list)  # TokenLogprobs, one per new token, when asked for
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while it runs
    error: str | None = None

    def extend(self, later: Delta) -> None:
        self.token_ids += later.token_ids
        self.text = None if self.text is None or later.text is None else self.text + later.text
        self.logprobs += later.logprobs
        self.finish_reason, self.error = later.finish_reason, later.error


class Job:
    """One HTTP request inside the engine: its prompts, and the queue its deltas arrive in. The
    engine thread only puts into the queue (through the event loop); the event loop reads it,
    decodes the text and counts the answers that finished."""

    def __init__(self, request_id: str, prompts: Prompts, loop: asyncio.AbstractEventLoop, tokenizer):
        self.request_id = request_id
        self.prompts = prompts
        self.loop = loop
        self.arrival = time.perf_counter()
        self.deltas: asyncio.Queue[list[Delta]] = asyncio.Queue()
        self.num_open = prompts.num_answers  # answers whose last delta has not been received
        answers = [ids for ids, params in zip(prompts.token_ids, prompts.params) for _ in params]
        # (a model without a tokenizer, random weights for a benchmark, answers token ids only: no text)
        self.decoders = [StreamDecoder(tokenizer, ids) if tokenizer is not None else None for ids in answers]
        self.outputs: list[list[int]] = [[] for _ in answers]  # each answer's tokens received so far
        # the engine thread's
        self.seqs: list[Sequence] = []
        self.sent: list[list[int]] = []  # per answer: tokens, characters, logprobs handed out so far

    @property
    def done(self) -> bool:
        """Every answer's last delta has been received."""
        return self.num_open == 0

    async def receive(self) -> list[Delta]:
        """What the answers gained since the last call, a delta per answer that gained anything:
        the engine's next step, or when the client fell behind, every step since, in one piece
        (the engine never waits for a client)."""
        steps = [await self.deltas.get()]
        while not self.deltas.empty():
            steps.append(self.deltas.get_nowait())
        merged: dict[int, Delta] = {}
        for deltas in steps:
            for d in deltas:
                if d.index in merged:
                    merged[d.index].extend(d)
                else:
                    merged[d.index] = d
        for d in merged.values():
            self.outputs[d.index] += d.token_ids
            if d.text is None:
                decoder = self.decoders[d.index]
                d.text = decoder.catch_up_at_once(self.outputs[d.index]) if decoder is not None else ""
            self.num_open -= d.finish_reason is not None
        return list(merged.values())


class EngineLoop:
    def __init__(self, build: Callable[[], object], metrics: Metrics,
                 make_view: Callable[[object], object] | None = None):
        """`build()`: the Loaded model and engine, made in the engine thread; `make_view(loaded)`: a
        live view to draw while it runs (live.py), or None."""
        self.build = build
        self.metrics = metrics
        self.make_view = make_view
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="pagedcli-engine", daemon=True)
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.loaded = None
        self.jobs: dict[int, tuple[Job, int]] = {}  # sequence id -> its job and its answer's index
        self.lock = threading.Lock()
        self.num_pending = 0  # answers added to the inbox and not yet to the engine
        self.num_engine_waiting = 0  # answers waiting in the engine after its last step
        self.num_free_slots = 0  # slots no answer held after the engine's last step
        self.stopped = False
        self.last_out = None  # the last step's StepOutput, for the live view's next frame

    # --- the event loop's side ------------------------------------------------------------------
    def start(self):
        """Build the engine in its thread and start stepping; returns the Loaded model, or raises
        what building it raised (a UsageError, say) here."""
        self.thread.start()
        self.ready.wait()
        if self.failure is not None:
            raise self.failure
        return self.loaded

    @property
    def num_waiting(self) -> int:
        """Answers that wait for a slot: in the engine's waiting queue, and those in the inbox that
        the free slots will not take."""
        return self.num_engine_waiting + max(0, self.num_pending - self.num_free_slots)

    def submit(self, job: Job) -> None:
        self._check_alive()
        with self.lock:
            self.num_pending += job.prompts.num_answers
        self.inbox.put(("add", job))

    def _check_alive(self) -> None:
        """A command for a thread that is gone would wait for ever: 503 at once instead."""
        if not self.thread.is_alive():
            raise APIError("the engine has stopped; restart the server", 503, type="server_error")

    def abort(self, job: Job) -> None:
        """The client went away: its answers end now and their blocks go back."""
        self.inbox.put(("abort", job))

    async def snapshot(self):
        """The cache as the engine has it between two steps (engine/snapshot.py)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.inbox.put(("snapshot", (loop, future)))
        return await future

    def end_all(self) -> None:
        """Every answer still open ends now ("abort": the server is shutting down); thread-safe."""
        self.inbox.put(("end_all", None))

    def stop(self) -> None:
        """Abort what still runs, stop the thread and wait for it (idempotent)."""
        if self.thread.is_alive():
            self.inbox.put(("stop", None))
            self.thread.join()

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.loaded = self.build()
        except BaseException as e:  # said by the command, in the main thread
            self.failure = e
            self.ready.set()
            return
        engine = self.loaded.engine
        self._count_waiting()
        self.metrics.describe(engine, self.loaded.source.name)
        view = self.make_view(self.loaded) if self.make_view else None
        self.ready.set()
        try:
            if view is not None:
                view.__enter__()
            while not self.stopped:
                if not engine.has_unfinished:  # idle: sleep until a command comes
                    try:
                        self._handle(*self.inbox.get(timeout=IDLE_TICK_S if view else None))
                    except queue.Empty:
                        pass
                self._drain()
                if self.stopped:
                    break
                if engine.has_unfinished:
                    self._step(engine)
                if view is not None:
                    view.after(self.last_out)  # a frame when one is due (live.py)
                    self.last_out = None
        finally:
            self._end_all("the server is shutting down", "abort")
            if view is not None:
                view.__exit__(None, None, None)

    def _drain(self) -> None:
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(*command)

    def _handle(self, kind: str, arg) -> None:
        """One command; one that fails (a bug) fails its own request, and the thread goes on."""
        try:
            self._command(kind, arg)
        except Exception as e:
            log.exception("serving a %s command failed", kind)
            if kind == "add":
                self._drop(arg)
                self._fail(arg, f"the server could not take the request: {e}")
            elif kind == "snapshot":
                loop, future = arg
                loop.call_soon_threadsafe(lambda error=e: future.done() or future.set_exception(error))

    def _drop(self, job: Job) -> int:
        """The engine ends `job`'s answers still open, and lets go of them: how many it ended."""
        engine = self.loaded.engine
        seqs = [s for s in job.seqs if not s.is_finished]
        if seqs:
            engine.abort(seqs)
        for seq in job.seqs:
            self.jobs.pop(seq.id, None)
        engine.forget()
        self._count_waiting()
        return len(seqs)

    def _fail(self, job: Job, why: str) -> None:
        """Every answer of `job` ends with an error, told `why`."""
        count = max(len(job.seqs), job.prompts.num_answers)
        self._send({job: [Delta(i, [], "", [], finish_reason="error", error=why) for i in range(count)]})

    def _command(self, kind: str, arg) -> None:
        engine = self.loaded.engine
        if kind == "add":
            with self.lock:  # out of the inbox, whatever adding it does
                self.num_pending -= arg.prompts.num_answers
            self._add(arg)
        elif kind == "abort":
            aborted = self._drop(arg)
            if aborted:
                self.metrics.aborted(aborted)
                self.metrics.gauges(engine)
        elif kind == "snapshot":
            loop, future = arg
            snap = engine.snapshot()
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(snap))
        elif kind == "end_all":
            self._end_all("the server is shutting down", "abort")
        elif kind == "stop":
            self.stopped = True

    def _add(self, job: Job) -> None:
        engine = self.loaded.engine
        p = job.prompts
        for ids, text, params in zip(p.token_ids, p.texts, p.params):
            seqs = [engine.add_request(ids, params[0], text)] if len(params) == 1 else engine.add_parallel(ids, params, text)
            for seq in seqs:
                seq.request_id = job.request_id if p.num_answers == 1 else f"{job.request_id}#{len(job.seqs)}"
                seq.arrival_time = job.arrival
                self.jobs[seq.id] = (job, len(job.seqs))
                job.seqs.append(seq)
                job.sent.append([0, 0, 0])
        if any(s.error for s in job.seqs):  # refused by the scheduler (the event loop's checks make it a 400 first)
            self._drop(job)  # the whole request fails
            self._fail(job, next(s.error for s in job.seqs if s.error))
        self._count_waiting()

    def _count_waiting(self) -> None:
        engine = self.loaded.engine
        sched = engine.scheduler
        self.num_engine_waiting = len(sched.waiting) + sum(len(c) for c in sched.forks.values())
        self.num_free_slots = max(0, engine.cache.max_slots - len(sched.running))

    def _step(self, engine) -> None:
        try:
            out = engine.step()
        except Exception as e:  # a bug or a failed allocation: every request so far ends, the server goes on
            oom = allocation_failure(e)
            log.exception("engine step failed") if oom is None else log.error(str(oom))
            self._end_all(f"the engine failed: {oom or e}", "error")
            return
        if out.idle:  # nothing could run (cannot happen with the checks up front): do not spin
            time.sleep(0.001)
        self.last_out = out
        now = time.perf_counter()
        batches: dict[Job, list[Delta]] = {}
        ran = {s.id for s in out.seqs}
        for seq in out.seqs + [s for s in out.finished if s.id not in ran]:  # (stop strings end ran ones)
            entry = self.jobs.get(seq.id)
            if entry is None:
                continue
            job, index = entry
            delta = self._delta(job, index, seq, now)
            if delta is not None:
                batches.setdefault(job, []).append(delta)
            if seq.is_finished:
                del self.jobs[seq.id]
        if out.finished:
            engine.forget()
        self._count_waiting()
        self.metrics.step(engine, now)
        self._send(batches)

    def _delta(self, job: Job, index: int, seq: Sequence, now: float) -> Delta | None:
        sent = job.sent[index]
        tokens = seq.output_token_ids[sent[0]:]
        # the text is decoded by the event loop, once per read; but for stop strings the engine's
        # (it holds back what may start one, and cuts the text before the one found)
        text = seq.stop_strings.text(seq.is_finished)[sent[1]:] if seq.stop_strings is not None else None
        logprobs = seq.logprobs[sent[2]:] if seq.params.logprobs is not None else []
        finish = seq.finish_reason if seq.is_finished else None
        if not tokens and not text and finish is None:
            return None
        self.metrics.tokens(seq, len(tokens), sent[0] == 0)
        if finish is not None:
            self.metrics.finished(seq, now)
        sent[0] += len(tokens)
        sent[1] += len(text or "")
        sent[2] += len(logprobs)
        return Delta(index, list(tokens), text, list(logprobs), finish, seq.error)

    def _send(self, batches: dict[Job, list[Delta]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, deltas in batches.items():
            by_loop.setdefault(job.loop, []).append((job, deltas))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                pass

    def _end_all(self, why: str, reason: str) -> None:
        """Every request still open ends now, told `why`."""
        engine = self.loaded.engine
        engine.abort_all()
        batches: dict[Job, list[Delta]] = {}
        for seq_id, (job, index) in self.jobs.items():
            batches.setdefault(job, []).append(Delta(index, [], "", [], finish_reason=reason, error=why))
        if self.jobs:
            self.metrics.aborted(len(self.jobs))
        self.jobs.clear()
        engine.forget()
        self._count_waiting()
        self.metrics.gauges(engine)
        self._send(batches)


def _deliver(items: list[tuple[Job, list[Delta]]]) -> None:
    for job, deltas in items:
        job.deltas.put_nowait(deltas)
