"""The engine: requests in, tokens out, one step at a time.

    step():  scheduler.schedule()  -> which sequences run and the tokens each feeds: a decode step,
                                      or a prefill step (prompts or their chunks, and with chunked
                                      prefill the decoding sequences' tokens beside them)
             runner.execute()      -> the forward pass over the paged cache: logits, greedy tokens
             sampler.sample()      -> penalties, temperature, min-p/top-k/top-p: one token per
                                      sequence that samples
             scheduler.update()    -> append, finish, give blocks back (advance(): prompt chunks;
                                      stop strings: stop_strings.py)

Each step returns a StepOutput saying what happened, which the CLI streams, the live view
draws and the benchmark times.

Overlap (on a GPU): a decode step's forward pass and sampling are only queued on the device; the
host learns the tokens when it needs them. Before it waits for them, the engine queues the next
decode step, which takes those tokens straight from device memory, and plans it as if every
sequence goes on (its blocks are taken one token early). So the host's bookkeeping for step n
runs while the GPU computes step n + 1, and in steady decoding the GPU does not wait for Python. A
sequence that a stop token ends at step n has computed one token in vain at step n + 1, which is
dropped (vLLM's async scheduling does the same). Prefills, prompt chunks, admissions and
preemptions are never planned ahead: the step before them is waited for. Stop strings end a
sequence as stop tokens do, once its tokens are on the host; penalties count the token a step
feeds on the device (sampler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedcli.engine.cache import KVCache
from pagedcli.engine.runner import ModelRunner
from pagedcli.engine.sampler import Sampler, StepLogprobs
from pagedcli.engine.scheduler import Schedule, Scheduler
from pagedcli.engine.sequence import SamplingParams, Sequence
from pagedcli.engine.snapshot import CacheSnapshot, take_snapshot
from pagedcli.engine.stop_strings import MakeDetokenizer, StopStrings
from pagedcli.errors import UsageError


@dataclass
class StepOutput:
    is_prefill: bool  # prompt tokens ran: prompts or chunks of them, maybe beside decoding sequences' tokens
    seqs: list[Sequence]  # the sequences that ran and sampled
    tokens: list[int]  # the token each sampled (a stop token is sampled but not appended)
    finished: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0  # tokens fed through the network
    num_decode: int = 0  # of those, the tokens of sequences decoding (in a prefill step: beside prompt chunks)
    used_blocks: int = 0  # blocks in use during the step (before finished sequences give theirs back)
    num_running: int = 0  # sequences holding a slot during the step
    prefilling: list[Sequence] = field(default_factory=list)  # ran a prompt chunk short of the prompt's end

    @property
    def idle(self) -> bool:
        """Nothing ran (nothing could be scheduled)."""
        return not self.seqs and not self.prefilling


@dataclass
class QueuedStep:
    """A step queued on the device: its sampled tokens exist there, and are on their way to the host."""

    is_prefill: bool
    seqs: list[Sequence]  # the rows that sample
    tokens: torch.Tensor  # [len(seqs)] int64 on the device: what the next step feeds without a round trip
    host_tokens: torch.Tensor  # the same on the host (pinned memory on a GPU), once `ready` has passed
    ready: torch.cuda.Event | None  # None on the CPU: the tokens are there already
    num_tokens: int
    num_decode: int
    used_blocks: int
    num_running: int
    chunks: tuple[list[Sequence], list[int]] = field(default_factory=lambda: ([], []))  # rows that fed a
    # prompt chunk short of their prompt's end: they sample nothing
    logprobs: StepLogprobs | None = None  # on their way to the host with the tokens

    def tokens_on_host(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # this step only: a step queued after it keeps running
        return self.host_tokens.tolist()


class Engine:
    def __init__(self, runner: ModelRunner, cache: KVCache, stop_ids, overlap: bool = False,
                 chunked_prefill: bool = False, max_num_batched_tokens: int | None = None,
                 detokenizer: MakeDetokenizer | None = None):
        self.runner = runner
        self.cache = cache  # its max_slots and max_model_len are the engine's
        vocab_size = runner.model.config.vocab_size
        self.scheduler = Scheduler(cache, set(stop_ids), max_num_batched_tokens, vocab_size=vocab_size,
                                   chunked_prefill=chunked_prefill)
        self.sampler = Sampler(cache.max_slots, vocab_size, cache.device)
        self.detokenizer = detokenizer  # for stop strings: the engine does not know the tokenizer
        self.sequences: list[Sequence] = []
        self.num_added = 0  # requests ever added: the next one's id (forget() keeps ids unique)
        self.num_forgotten = {"finished": 0, "aborted": 0}  # ended requests let go by forget()
        self.num_steps = 0
        self.overlap = overlap  # queue the next decode step before this one's tokens are on the host
        self.in_flight: QueuedStep | None = None  # a decode step queued ahead, finished by the next step()
        self.num_launched_ahead = 0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        seq = self._watch_stops(Sequence(self.num_added, prompt_token_ids, params, prompt))
        self.num_added += 1
        self.sequences.append(seq)
        self.scheduler.add(seq)
        return seq

    def add_parallel(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     prompt: str | None = None) -> list[Sequence]:
        """`len(params)` samples of one prompt that share its blocks (copy-on-write)."""
        seqs = [self._watch_stops(Sequence(self.num_added + i, prompt_token_ids, p, prompt))
                for i, p in enumerate(params)]
        self.num_added += len(seqs)
        self.sequences.extend(seqs)
        self.scheduler.add_parallel(seqs[0], seqs[1:])
        return seqs

    def _watch_stops(self, seq: Sequence) -> Sequence:
        if seq.params.stop:
            if self.detokenizer is None:
                raise UsageError("`stop` needs the text, and this model has no tokenizer", "leave `stop` out")
            seq.stop_strings = StopStrings(seq.params.stop, self.detokenizer(seq.prompt_token_ids))
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        step, self.in_flight = self.in_flight, None
        if step is None:
            plan = self.scheduler.schedule()
            if not plan.seqs:
                return StepOutput(plan.is_prefill, [], [])
            step = self._queue_step(plan)
        if self.overlap and not step.is_prefill:
            ahead = self.scheduler.schedule_ahead(step.seqs)
            if ahead:
                self.in_flight = self._queue_step(Schedule(ahead, [1] * len(ahead), False), after=step)
                self.num_launched_ahead += 1
        return self._finish(step)

    def _queue_step(self, plan: Schedule, after: QueuedStep | None = None) -> QueuedStep:
        """Queue the forward pass and the sampling of one step. `after`: the decode step still in
        flight whose tokens this (decode) step feeds, taken from the device."""
        seqs, is_prefill = plan.seqs, plan.is_prefill
        num_tokens = sum(plan.num_new)
        # a decoding row feeds the one token it generated last (a recomputed sequence's last prompt token counts too)
        num_decode = sum(n == 1 and bool(s.output_token_ids) and s.num_cached == len(s) - 1
                         for s, n in zip(seqs, plan.num_new)) if is_prefill else len(seqs)
        chunks: tuple[list[Sequence], list[int]] = ([], [])
        if is_prefill:  # rows whose chunk stops short of their prompt's end get no logits
            samples = plan.samples
            chunks = ([s for s, ok in zip(seqs, samples) if not ok], [n for n, ok in zip(plan.num_new, samples) if not ok])
        used_blocks = self.cache.geometry.num_blocks - self.cache.num_free_blocks
        num_running = len(self.scheduler.running)
        feed = None
        if after is not None:  # `seqs` are `after.seqs` less the ones that end with it, in order
            if len(seqs) == len(after.seqs):
                feed = after.tokens
            else:
                row = {s.id: i for i, s in enumerate(after.seqs)}
                feed = after.tokens[torch.tensor([row[s.id] for s in seqs]).to(after.tokens.device, non_blocking=True)]
        logits, greedy = self.runner.execute(seqs, is_prefill, feed, plan.num_new if is_prefill else None)
        if chunks[0]:
            seqs = [s for s, ok in zip(seqs, samples) if ok]
        if is_prefill:  # parallel samples join their prompt's parent, and sample from its row
            seqs, rows = self.scheduler.fork(seqs)
            if rows is not None:
                index = torch.tensor(rows).to(logits.device)
                logits, greedy = logits[index], greedy[index]
        tokens, logprobs = self.sampler.sample(logits, greedy, seqs)
        if tokens.is_cuda:
            host, ready = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True), torch.cuda.Event()
            host.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                logprobs.to_host()
            ready.record()
        else:
            host, ready = tokens, None
        return QueuedStep(is_prefill, seqs, tokens, host, ready, num_tokens, num_decode, used_blocks, num_running,
                          chunks, logprobs)

    def _finish(self, step: QueuedStep) -> StepOutput:
        """Wait for a step's tokens; append them, finish sequences, give blocks back."""
        tokens = step.tokens_on_host()
        seqs = step.seqs
        if any(s.is_finished for s in seqs):  # ended by a stop token while this step was queued
            kept = [i for i, s in enumerate(seqs) if not s.is_finished]
            seqs, tokens = [seqs[i] for i in kept], [tokens[i] for i in kept]
        self.scheduler.advance(*step.chunks)
        now = time.perf_counter()
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
        finished = self.scheduler.update(seqs, tokens)
        if step.logprobs is not None:
            step.logprobs.attach(step.seqs)
        finished += self._stop_strings(seqs)
        if self.in_flight is not None and all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # every row of the step ahead is void: nobody waits for it
        self.num_steps += 1
        return StepOutput(step.is_prefill, seqs, tokens, finished, step.num_tokens, step.num_decode, step.used_blocks,
                          step.num_running,
                          step.chunks[0])

    def _stop_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        """End the sequences whose text now holds a stop string, as a stop token would: those that
        were still running. A stop string outranks the length limit (vLLM's finish_reason)."""
        ended = []
        for seq in seqs:
            if seq.stop_strings is None or seq.error or not seq.stop_strings.update(seq.output_token_ids):
                continue
            if not seq.is_finished:
                self.scheduler.finish(seq)
                ended.append(seq)
            seq.finish_reason = "stop"
        return ended

    def run_to_completion(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Run prompts to completion; returns their sequences in input order."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished:
            self.step()
        return seqs

    def reset(self) -> None:
        """Forget what ran (its sequences, counters and cached prefixes); compiled kernels, captured
        graphs and allocations stay warm. Only between runs: nothing may be unfinished."""
        assert not self.has_unfinished, "reset with requests still running"
        self.sequences.clear()
        self.num_steps = self.num_launched_ahead = self.num_added = 0
        self.num_forgotten = dict.fromkeys(self.num_forgotten, 0)
        self.scheduler.reset()
        self.cache.reset()

    def abort_all(self) -> None:
        """Finish every unfinished request now (Ctrl-C): every block goes back."""
        self.in_flight = None  # its rows end with everyone else's
        self.scheduler.abort_all()
        self.cache.drop_pending_copies()

    def abort(self, seqs: list[Sequence]) -> None:
        """End these requests now (their client went away), as aborted: their slots and blocks go
        back, the others go on. A decode step queued ahead still computes their rows on the device;
        the next step() drops them, as it does for a stop token."""
        for seq in seqs:
            self.scheduler.abort(seq)
        if self.in_flight is not None and all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # every row of the step ahead is void: nobody waits for it

    def forget(self) -> None:
        """Let go of the requests that ended (a server runs for ever; its requests must not pile
        up): the snapshot still counts them."""
        if not any(s.is_finished for s in self.sequences):
            return
        for seq in self.sequences:
            if seq.is_finished:
                self.num_forgotten["aborted" if seq.finish_reason == "abort" else "finished"] += 1
        self.sequences = [s for s in self.sequences if not s.is_finished]

    def snapshot(self) -> CacheSnapshot:
        return take_snapshot(self)
