"""The engine's process: it builds the model and the engine, steps while anything is unfinished,
takes the API process's commands between steps, and after each turn sends back one message with
every answer's new tokens.

Why a process of its own (vLLM's EngineCore split): in one process the engine's thread and the
HTTP event loop take turns at one GIL, and on a GPU the engine's host work between two steps is
what keeps the GPU busy. Here the engine has an interpreter to itself; the API process
(engine_client.py) turns its messages into server-sent events.

Two one-way pipes a link carry plain tuples, cheap to pickle: the API process's commands (written by
its event loop, command_pipe.py) and this process's messages (pickled with `pickle.dumps`, which
multiprocessing's Connection.recv reads: its own pickler copies a dispatch table each call):

    API -> engine   ("add", key, request_id, arrival, prompts)   a request (sampling.Prompts)
                    ("abort", key)                               its client went away
                    ("snapshot", key)                            the cache between two steps
                    ("end_all",)                                 every open answer of the link's ends ("abort")
                    ("stop",)                                    end them, and close the link
                    ("log", text)                                a line above the live view
    engine -> API   ("ready", Ready) or ("failed", error)        once, after the build
                    ("step", tokens, deltas, report)             after a turn that changed anything
                    ("beat",)                                    after HEARTBEAT_S without another
                    ("snapshot", key, snapshot, None) or (..., None, error)

a delta: (key, index, token_ids, text, logprobs, finish_reason, error), what answer `index` of
request `key` gained (text None: the API process decodes it); tokens: the common case, an answer
that gained one token and nothing else, as (key, index, token) triples in one flat array('q'),
which pickles as one string of bytes (several times faster both ways than a tuple of lists an
answer: docs/performance-log.md, "The host's own work"); report: metrics.StepReport.

One link an API process (`pagedcli serve --api-server-count N`: N of them, one engine): each link's
request keys are its own, its messages carry its own answers, and every link gets each turn's
report (the numbers are the engine's, so each API process's /metrics shows the whole server). The
process ends once every link has said stop or closed.

The process ignores the STOP_SIGNALS (a terminal sends Ctrl-C, and its hang-up, to the whole process
group: the API process decides how the server ends, and tells this one), and ends when the API
processes are gone: their ends of the pipes close, so a read here sees EOF and a write fails."""

from __future__ import annotations

import logging
import pickle
import select
import sys
import time
import traceback
from array import array
from dataclasses import dataclass

from pagedcli.core.errors import PagedCliError, RunError, allocation_failure
from pagedcli.core.geometry import CacheGeometry
from pagedcli.core.heap import frozen_heap
from pagedcli.engine.scheduler import PromptLimits
from pagedcli.engine.sequence import Sequence, Status
from pagedcli.model.tokenizer import Tokenizer
from pagedcli.serve import LOG_FORMAT, ignore_stop_signals
from pagedcli.serve.metrics import Tally

log = logging.getLogger("pagedcli.serve")
IDLE_TICK_S = 0.2  # an idle engine wakes this often when a live view wants frames
# An engine that has sent nothing for this long sends a heartbeat ("beat",): every message is one, so
# the API process knows the engine answers (its /health: engine_client.py), idle or stepping
HEARTBEAT_S = 1.0
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
    stop_ids: tuple[int, ...] = ()  # what ends an answer (a grammar lets only these follow a whole answer)


def main(links: list, build, args: tuple, live: bool) -> None:
    """The process: `build(*args)` (a module-level function, so that it pickles by name) gives
    the Loaded model and engine; `links`: (messages out, commands in) a pair of pipes for each API
    process; `live`: draw the live view on this process's stdout."""
    ignore_stop_signals()
    try:
        try:
            loaded = build(*args)
        except BaseException as e:  # said by the API process, which exits with the error's code
            links[0][0].send(("failed", as_error(e)))
            return
        engine = loaded.engine
        view = None
        if live:
            from rich.console import Console

            from pagedcli.serve.live import ServerView

            view = ServerView(engine, Console(file=sys.stdout), loaded.tokenizer and loaded.tokenizer.decode)
        log_to(view.out if view is not None else sys.stderr)
        with frozen_heap():
            ready = Ready(loaded.source.name, loaded.source.generation_config, loaded.tokenizer,
                          engine.scheduler.limits, engine.cache.max_slots, engine.cache.geometry,
                          tuple(loaded.source.stop_ids))
            for conn, _ in links:
                conn.send(("ready", ready))
            EngineProcess([Link(*pair) for pair in links], engine, view).run()
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


class Link:
    """One API process's pipes, and what this process has for it until its next message."""

    def __init__(self, conn, inbox):
        self.conn = conn  # messages out
        self.inbox = inbox  # commands in
        self.pending = select.poll()  # whether a command waits (Connection.poll builds a selector each call)
        self.pending.register(inbox.fileno(), select.POLLIN)
        self.deltas: list[tuple] = []  # for the next message
        self.tokens = array("q")  # for the next message too: (key, index, token), the answers that gained one token
        self.num_taken = 0  # answers taken out of its pipe so far (its API process counts those in it)
        self.open = True  # until it has said stop (and had its last message), or its API process is gone
        self.stopping = False  # it has said stop: its requests have ended, its last message is due

    def send(self, message: tuple) -> None:
        if self.open:
            try:
                self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            except OSError:  # its API process is gone: the next read of its pipe closes the link
                pass


class EngineProcess:
    def __init__(self, links: list[Link], engine, view=None):
        self.links = links
        self.engine = engine
        self.view = view
        self.answers: dict[int, tuple[Link, int, int, list[int]]] = {}  # seq id -> link, request key, index, what was sent
        self.requests: dict[tuple[int, int], list[Sequence]] = {}  # (link id, request key) -> its answers' sequences
        self.waiting = select.poll()  # any link's command, or a link closing: the idle engine's wake-up
        for link in links:
            self.waiting.register(link.inbox.fileno(), select.POLLIN)
        self.tally = Tally()
        self.changed = False  # the next messages have something to say
        self.last_sent = time.monotonic()  # when the links last heard from this process
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
                # idle: wait for a command, at most a heartbeat's time (with a live view, a tick: it redraws)
                idle_ms = int(1000 * (IDLE_TICK_S if view is not None else HEARTBEAT_S))
                if engine.has_unfinished or self.waiting.poll(idle_ms):
                    for link in self.links:
                        self._take_commands(link)
                if engine.has_unfinished and not self.stopped:
                    out = self._step()
                if self.changed:
                    self._send()
                elif time.monotonic() - self.last_sent >= HEARTBEAT_S:
                    self._beat()
                for link in self.links:
                    if link.stopping:
                        self._close(link)
                if view is not None:
                    view.after(out)  # a frame when one is due (live.py)
        finally:
            if view is not None:
                view.__exit__(None, None, None)

    def _take_commands(self, link: Link) -> None:
        """Every command waiting in `link`'s pipe; one whose API process is gone closes it."""
        try:
            while link.open and not link.stopping and link.pending.poll(0):
                self._handle(link, link.inbox.recv())
        except (EOFError, OSError):
            self._close(link)

    # --- commands --------------------------------------------------------------------------------
    def _handle(self, link: Link, command: tuple) -> None:
        """One command; one that fails (a bug) fails its own request, and the engine goes on."""
        kind = command[0]
        try:
            self.commands[kind](link, *command[1:])
        except Exception as e:
            log.exception("serving a %s command failed", kind)
            if kind == "add":
                key, prompts = command[1], command[4]
                self._drop(link, key)
                self._fail(link, key, prompts.num_answers, f"the server could not take the request: {e}")
            elif kind == "snapshot":
                link.send(("snapshot", command[1], None, str(e)))
        self.changed = True

    def _add(self, link: Link, key: int, request_id: str, arrival: float, prompts) -> None:
        engine = self.engine
        link.num_taken += prompts.num_answers  # counted first: whatever adding it does, it left the pipe
        seqs = self.requests[id(link), key] = []
        for ids, text, params in zip(prompts.token_ids, prompts.texts, prompts.params):
            added = ([engine.add_request(ids, params[0], text)] if len(params) == 1
                     else engine.add_parallel(ids, params, text))
            for seq in added:
                seq.request_id = request_id if prompts.num_answers == 1 else f"{request_id}#{len(seqs)}"
                seq.arrival_time = arrival  # perf_counter: one clock for both processes (CLOCK_MONOTONIC)
                self.answers[seq.id] = (link, key, len(seqs), [0, 0, 0, 0])
                seqs.append(seq)
        if any(s.error for s in seqs):  # refused by the scheduler (the API process's checks make it a 400 first)
            why = next(s.error for s in seqs if s.error)
            self._drop(link, key)  # the whole request fails
            self._fail(link, key, prompts.num_answers, why)

    def _abort(self, link: Link, key: int) -> None:
        """The client went away: its answers end now and their blocks go back."""
        self.tally.aborted(self._drop(link, key))

    def _snapshot(self, link: Link, key: int) -> None:
        link.send(("snapshot", key, self.engine.snapshot(), None))

    def _end_all(self, link: Link | None, why: str = SHUTTING_DOWN, reason: str = "abort") -> None:
        """Every request of `link`'s (None: of every link's) still open ends now, told `why`."""
        ending = [(seq_id, entry) for seq_id, entry in self.answers.items() if link is None or entry[0] is link]
        if len(ending) == len(self.answers):  # every request there is (one API process, or a failed step)
            self.engine.abort_all()
            self.requests.clear()
        else:
            self.engine.abort([seq for key in [k for k in self.requests if k[0] == id(link)]
                               for seq in self.requests.pop(key) if not seq.is_finished])
        for seq_id, (owner, key, index, _) in ending:
            owner.deltas.append((key, index, [], "", [], reason, why))
            del self.answers[seq_id]
        self.tally.aborted(len(ending))
        self.engine.forget()

    def _stop(self, link: Link) -> None:
        """`link`'s API process is done: its requests end, the turn's message tells it, and the link
        closes; once every link has, this process ends."""
        self._end_all(link)
        link.stopping = True

    def _close(self, link: Link) -> None:
        if not link.open:
            return
        if any(entry[0] is link for entry in self.answers.values()):  # gone without a stop: nobody reads them
            self._end_all(link)
        link.open = link.stopping = False
        self.waiting.unregister(link.inbox.fileno())
        link.conn.close()  # its API process reads EOF: the engine has let it go
        self.stopped = not any(l.open for l in self.links)

    def _log(self, link: Link, text: str) -> None:
        if self.view is not None:
            self.view.out.write(text)

    def _drop(self, link: Link, key: int) -> int:
        """The engine ends request `key`'s answers still open, and lets go of them: how many it ended."""
        seqs = self.requests.pop((id(link), key), [])
        running = [s for s in seqs if not s.is_finished]
        if running:
            self.engine.abort(running)
        for seq in seqs:
            self.answers.pop(seq.id, None)
        self.engine.forget()
        return len(running)

    def _fail(self, link: Link, key: int, num_answers: int, why: str) -> None:
        """Every answer of request `key` ends with an error, told `why`."""
        link.deltas += [(key, i, [], "", [], "error", why) for i in range(num_answers)]

    # --- a step ----------------------------------------------------------------------------------
    def _step(self):
        engine = self.engine
        self.changed = True
        try:
            out = engine.step()
        except Exception as e:  # a bug or a failed allocation: every request so far ends, the server goes on
            oom = allocation_failure(e)
            log.exception("engine step failed") if oom is None else log.error(str(oom))
            self._end_all(None, f"the engine failed: {oom or e}", "error")
            return None
        if out.idle:  # nothing could run (cannot happen with the checks up front): do not spin
            time.sleep(0.001)
        now = time.perf_counter()
        answers, tally = self.answers, self.tally
        for seq in out.seqs:
            entry = answers.get(seq.id)
            if entry is None:
                continue
            link, key, index, sent = entry
            if sent[0] and sent[0] + 1 == len(seq.output_token_ids) and seq.status is Status.RUNNING \
                    and seq.stop_strings is None and seq.params.logprobs is None and not seq.matcher:
                link.tokens.extend((key, index, seq.output_token_ids[-1]))  # one token, and nothing else to say
                sent[0] += 1
                tally.next_token(seq)
            else:
                self._delta(seq, link, key, index, sent, now)
        if out.finished:
            ran = {s.id for s in out.seqs}
            for seq in out.finished:
                if seq.id not in ran and (entry := answers.get(seq.id)) is not None:  # (stop strings end ran ones)
                    self._delta(seq, *entry, now)
            engine.forget()
        tally.stepped(now)
        return out

    def _delta(self, seq: Sequence, link: Link, key: int, index: int, sent: list[int], now: float) -> None:
        tokens = seq.output_token_ids[sent[0]:]
        # the text is decoded by the API process, once per read; but for stop strings the engine's
        # (it holds back what may start one, and cuts the text before the one found)
        text = seq.stop_strings.text_since(sent[1], seq.is_finished) if seq.stop_strings is not None else None
        logprobs = seq.logprobs[sent[2]:] if seq.params.logprobs is not None else []
        # the prompt's, once, with the first delta (all of them are in by the first token)
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None and not sent[3] else None
        finish = seq.finish_reason if seq.is_finished else None
        if seq.is_finished:
            del self.answers[seq.id]
            seqs = self.requests.get((id(link), key))
            if seqs is not None and all(s.is_finished for s in seqs):
                del self.requests[id(link), key]
        if not tokens and not text and finish is None:
            return
        self.tally.tokens(seq, len(tokens), sent[0] == 0)
        if finish is not None:
            self.tally.finished(seq, now)
        sent[0] += len(tokens)
        sent[1] += len(text or "")
        sent[2] += len(logprobs)
        sent[3] = sent[3] or prompt_logprobs is not None
        link.deltas.append((key, index, list(tokens), text, list(logprobs), finish, seq.error, prompt_logprobs))

    def _send(self) -> None:
        """A message a link: its deltas since the last, and the numbers the metrics and --max-waiting need."""
        report = self.tally.report(self.engine)
        for link in self.links:
            link.send(("step", link.tokens, link.deltas, report._replace(num_taken=link.num_taken)))
            link.deltas, link.tokens = [], array("q")
        self.changed = False
        self.last_sent = time.monotonic()

    def _beat(self) -> None:
        for link in self.links:
            link.send(("beat",))
        self.last_sent = time.monotonic()
