"""The engine's process: it builds the model and the engine, steps while anything is unfinished,
takes the API process's commands between steps, and after each turn sends back one message with
every answer's new tokens.

Why a process of its own (vLLM's EngineCore split): in one process the engine's thread and the
HTTP event loop take turns at one GIL, and on a GPU the engine's host work between two steps is
what keeps the GPU busy. Here the engine has an interpreter to itself; the API process
(engine_client.py) turns its messages into server-sent events.

Two one-way pipes carry plain tuples, cheap to pickle: the API process's commands (written by its
event loop, command_pipe.py) and this process's messages (pickled with `pickle.dumps`, which
multiprocessing's Connection.recv reads: its own pickler copies a dispatch table each call):

    API -> engine   ("add", key, request_id, arrival, prompts)   a request (sampling.Prompts)
                    ("abort", key)                               its client went away
                    ("snapshot", key)                            the cache between two steps
                    ("end_all",)                                 every open answer ends ("abort")
                    ("stop",)                                    end them, and exit
                    ("log", text)                                a line above the live view
    engine -> API   ("ready", Ready) or ("failed", error)        once, after the build
                    ("step", tokens, deltas, report)             after a turn that changed anything
                    ("snapshot", key, snapshot, None) or (..., None, error)

a delta: (key, index, token_ids, text, logprobs, finish_reason, error), what answer `index` of
request `key` gained (text None: the API process decodes it); tokens: the common case, an answer
that gained one token and nothing else, as (key, index, token) triples in one flat array('q'),
which pickles as one string of bytes (64 tuples of lists took 8 us to pickle and 12 to unpickle,
the array 2.5 and 2); report: metrics.StepReport.

The process ignores SIGINT and SIGTERM (a terminal sends Ctrl-C to the whole process group: the
API process decides how the server ends, and tells this one), and ends when the API process is
gone: its end of the pipe closes, so a read here sees EOF and a write fails."""

from __future__ import annotations

import logging
import pickle
import select
import signal
import sys
import time
import traceback
from array import array
from dataclasses import dataclass

from pagedcli.engine.scheduler import PromptLimits
from pagedcli.engine.sequence import Sequence, Status
from pagedcli.errors import PagedCliError, RunError, allocation_failure
from pagedcli.heap import frozen_heap
from pagedcli.model.config import CacheGeometry
from pagedcli.model.tokenizer import Tokenizer
from pagedcli.serve import LOG_FORMAT
from pagedcli.serve.metrics import Tally

log = logging.getLogger("pagedcli.serve")
IDLE_TICK_S = 0.2  # an idle engine wakes this often only when a live view wants frames
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Ready:
    """What the API process needs of the built model: to check and tokenize requests, name the
    model, and size its metrics."""

    model_name: str
    generation_config: dict
    tokenizer: Tokenizer | None  # None: random weights, prompts of token ids only
    limits: PromptLimits
    max_slots: int
    geometry: CacheGeometry


def main(conn, commands, build, args: tuple, live: bool) -> None:
    """The process: `build(*args)` (a module-level function, so that it pickles by name) gives
    the Loaded model and engine; `commands`: the pipe the API process's commands come by, `conn`
    the one this process's messages go by; `live`: draw the live view on this process's stdout."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    try:
        try:
            loaded = build(*args)
        except BaseException as e:  # said by the API process, which exits with the error's code
            conn.send(("failed", as_error(e)))
            return
        engine = loaded.engine
        view = None
        if live:
            from rich.console import Console

            from pagedcli.serve.live import ServerView

            view = ServerView(engine, Console(file=sys.stdout), loaded.tokenizer and loaded.tokenizer.decode)
        log_to(view.out if view is not None else sys.stderr)
        with frozen_heap():
            conn.send(("ready", Ready(loaded.source.name, loaded.source.generation_config, loaded.tokenizer,
                                      engine.scheduler.limits, engine.cache.max_slots, engine.cache.geometry)))
            EngineProcess(conn, commands, engine, view).run()
    except (EOFError, OSError):  # the API process is gone (killed, or it ended): nobody to answer
        pass


def as_error(e: BaseException) -> PagedCliError:
    """A build failure as the one-line error the command shows (a bug: with its traceback here)."""
    if isinstance(e, PagedCliError):
        return e
    if (oom := allocation_failure(e)) is not None:
        return oom
    traceback.print_exc()
    return RunError(f"the engine could not be built: {type(e).__name__}: {e}")


def log_to(stream) -> None:
    """This process's log lines (a step that failed), in the API process's format."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
    log.propagate = False


class EngineProcess:
    def __init__(self, conn, commands, engine, view=None):
        self.conn = conn  # messages out
        self.inbox = commands  # commands in
        self.engine = engine
        self.view = view
        self.answers: dict[int, tuple[int, int, list[int]]] = {}  # seq id -> request key, index, what was sent
        self.requests: dict[int, list[Sequence]] = {}  # request key -> its answers' sequences
        self.deltas: list[tuple] = []  # for the next message
        self.tokens = array("q")  # for the next message too: (key, index, token), the answers that gained one token
        self.pending = select.poll()  # whether a command waits (Connection.poll builds a selector each call)
        self.pending.register(commands.fileno(), select.POLLIN)
        self.tally = Tally()
        self.num_taken = 0  # answers taken out of the pipe so far (the API process counts those in it)
        self.changed = False  # the next message has something to say
        self.stopped = False
        self.commands = {"add": self._add, "abort": self._abort, "snapshot": self._snapshot, "end_all": self._end_all,
                         "stop": self._stop, "log": self._log}

    def run(self) -> None:
        engine, view = self.engine, self.view
        if view is not None:
            view.__enter__()
        try:
            while not self.stopped:
                out = None
                # idle: wait for a command (with a live view, at most a tick: it redraws)
                if engine.has_unfinished or self.inbox.poll(IDLE_TICK_S if view is not None else None):
                    while self.pending.poll(0):
                        self._handle(self.inbox.recv())
                if engine.has_unfinished and not self.stopped:
                    out = self._step()
                if self.changed:
                    self._send()
                if view is not None:
                    view.after(out)  # a frame when one is due (live.py)
        finally:
            if view is not None:
                view.__exit__(None, None, None)

    # --- commands --------------------------------------------------------------------------------
    def _handle(self, command: tuple) -> None:
        """One command; one that fails (a bug) fails its own request, and the engine goes on."""
        kind = command[0]
        try:
            self.commands[kind](*command[1:])
        except Exception as e:
            log.exception("serving a %s command failed", kind)
            if kind == "add":
                key, prompts = command[1], command[4]
                self._drop(key)
                self._fail(key, prompts.num_answers, f"the server could not take the request: {e}")
            elif kind == "snapshot":
                self.conn.send(("snapshot", command[1], None, str(e)))
        self.changed = True

    def _add(self, key: int, request_id: str, arrival: float, prompts) -> None:
        engine = self.engine
        self.num_taken += prompts.num_answers  # counted first: whatever adding it does, it left the pipe
        seqs = self.requests[key] = []
        for ids, text, params in zip(prompts.token_ids, prompts.texts, prompts.params):
            added = ([engine.add_request(ids, params[0], text)] if len(params) == 1
                     else engine.add_parallel(ids, params, text))
            for seq in added:
                seq.request_id = request_id if prompts.num_answers == 1 else f"{request_id}#{len(seqs)}"
                seq.arrival_time = arrival  # perf_counter: one clock for both processes (CLOCK_MONOTONIC)
                self.answers[seq.id] = (key, len(seqs), [0, 0, 0])
                seqs.append(seq)
        if any(s.error for s in seqs):  # refused by the scheduler (the API process's checks make it a 400 first)
            why = next(s.error for s in seqs if s.error)
            self._drop(key)  # the whole request fails
            self._fail(key, prompts.num_answers, why)

    def _abort(self, key: int) -> None:
        """The client went away: its answers end now and their blocks go back."""
        self.tally.aborted(self._drop(key))

    def _snapshot(self, key: int) -> None:
        self.conn.send(("snapshot", key, self.engine.snapshot(), None))

    def _end_all(self, why: str = SHUTTING_DOWN, reason: str = "abort") -> None:
        """Every request still open ends now, told `why`."""
        self.engine.abort_all()
        for key, index, _ in self.answers.values():
            self.deltas.append((key, index, [], "", [], reason, why))
        self.tally.aborted(len(self.answers))
        self.answers.clear()
        self.requests.clear()
        self.engine.forget()

    def _stop(self) -> None:
        self._end_all()
        self.stopped = True

    def _log(self, text: str) -> None:
        if self.view is not None:
            self.view.out.write(text)

    def _drop(self, key: int) -> int:
        """The engine ends request `key`'s answers still open, and lets go of them: how many it ended."""
        seqs = self.requests.pop(key, [])
        running = [s for s in seqs if not s.is_finished]
        if running:
            self.engine.abort(running)
        for seq in seqs:
            self.answers.pop(seq.id, None)
        self.engine.forget()
        return len(running)

    def _fail(self, key: int, num_answers: int, why: str) -> None:
        """Every answer of request `key` ends with an error, told `why`."""
        self.deltas += [(key, i, [], "", [], "error", why) for i in range(num_answers)]

    # --- a step ----------------------------------------------------------------------------------
    def _step(self):
        engine = self.engine
        self.changed = True
        try:
            out = engine.step()
        except Exception as e:  # a bug or a failed allocation: every request so far ends, the server goes on
            oom = allocation_failure(e)
            log.exception("engine step failed") if oom is None else log.error(str(oom))
            self._end_all(f"the engine failed: {oom or e}", "error")
            return None
        if out.idle:  # nothing could run (cannot happen with the checks up front): do not spin
            time.sleep(0.001)
        now = time.perf_counter()
        answers, tokens, tally = self.answers, self.tokens, self.tally
        for seq in out.seqs:
            entry = answers.get(seq.id)
            if entry is None:
                continue
            key, index, sent = entry
            if sent[0] and sent[0] + 1 == len(seq.output_token_ids) and seq.status is Status.RUNNING \
                    and seq.stop_strings is None and seq.params.logprobs is None:
                tokens.extend((key, index, seq.output_token_ids[-1]))  # one token, and nothing else to say
                sent[0] += 1
                tally.next_token(seq)
            else:
                self._delta(seq, key, index, sent, now)
        if out.finished:
            ran = {s.id for s in out.seqs}
            for seq in out.finished:
                if seq.id not in ran and (entry := answers.get(seq.id)) is not None:  # (stop strings end ran ones)
                    self._delta(seq, *entry, now)
            engine.forget()
        tally.stepped(now)
        return out

    def _delta(self, seq: Sequence, key: int, index: int, sent: list[int], now: float) -> None:
        tokens = seq.output_token_ids[sent[0]:]
        # the text is decoded by the API process, once per read; but for stop strings the engine's
        # (it holds back what may start one, and cuts the text before the one found)
        text = seq.stop_strings.text(seq.is_finished)[sent[1]:] if seq.stop_strings is not None else None
        logprobs = seq.logprobs[sent[2]:] if seq.params.logprobs is not None else []
        finish = seq.finish_reason if seq.is_finished else None
        if seq.is_finished:
            del self.answers[seq.id]
            seqs = self.requests.get(key)
            if seqs is not None and all(s.is_finished for s in seqs):
                del self.requests[key]
        if not tokens and not text and finish is None:
            return
        self.tally.tokens(seq, len(tokens), sent[0] == 0)
        if finish is not None:
            self.tally.finished(seq, now)
        sent[0] += len(tokens)
        sent[1] += len(text or "")
        sent[2] += len(logprobs)
        self.deltas.append((key, index, list(tokens), text, list(logprobs), finish, seq.error))

    def _send(self) -> None:
        """One message: the deltas since the last, and the numbers the metrics and --max-waiting need."""
        message = ("step", self.tokens, self.deltas, self.tally.report(self.engine, self.num_taken))
        self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        self.deltas, self.tokens = [], array("q")
        self.changed = False
