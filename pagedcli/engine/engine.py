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
preemptions are never planned ahead: the step before them is waited for; nor is a step with a
request held to a grammar (structured.py), whose mask needs the token before it. Stop strings end a
sequence as stop tokens do, once its tokens are on the host; penalties count the token a step
feeds on the device (sampler.py).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from pagedcli.core.errors import UsageError
from pagedcli.core.options import SamplingParams
from pagedcli.engine import structured
from pagedcli.engine.cache import KVCache
from pagedcli.engine.outputs import QueuedStep, StepCounts, StepOutput
from pagedcli.engine.runner import ModelRunner
from pagedcli.engine.sampler import PromptLogprobs, Sampler
from pagedcli.engine.scheduler import Schedule, Scheduler
from pagedcli.engine.sequence import Sequence
from pagedcli.engine.snapshot import CacheSnapshot, take_snapshot
from pagedcli.engine.stop_strings import MakeDetokenizer, StopStrings
from pagedcli.engine.structured import StructuredOutputs


class Engine:
    def __init__(self, runner: ModelRunner, cache: KVCache, stop_ids, overlap: bool = False,
                 chunked_prefill: bool = False, max_num_batched_tokens: int | None = None,
                 detokenizer: MakeDetokenizer | None = None,
                 structured: Callable[[], StructuredOutputs] | None = None):
        self.runner = runner
        self.cache = cache  # its max_slots and max_model_len are the engine's
        vocab_size = runner.model.config.vocab_size
        self.scheduler = Scheduler(cache, set(stop_ids), max_num_batched_tokens, vocab_size=vocab_size,
                                   chunked_prefill=chunked_prefill)
        self.sampler = Sampler(cache.max_slots, vocab_size, cache.device)
        self.detokenizer = detokenizer  # for stop strings: the engine does not know the tokenizer
        self._make_structured = structured  # the vocabulary for grammars, made at the first that asks
        self._structured: StructuredOutputs | None = None
        self.sequences: list[Sequence] = []
        self.num_added = 0  # requests ever added: the next one's id (forget() keeps ids unique)
        self.num_forgotten = {"finished": 0, "aborted": 0}  # ended requests let go by forget()
        self.num_steps = 0
        self.overlap = overlap  # queue the next decode step before this one's tokens are on the host
        self.in_flight: QueuedStep | None = None  # a decode step queued ahead, finished by the next step()
        self.num_launched_ahead = 0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        seq = self._constrain(self._watch_stops(Sequence(self.num_added, prompt_token_ids, params, prompt)))
        self.num_added += 1
        self.sequences.append(seq)
        self.scheduler.add(seq)
        return seq

    def add_parallel(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     prompt: str | None = None) -> list[Sequence]:
        """`len(params)` samples of one prompt that share its blocks (copy-on-write)."""
        seqs = [self._constrain(self._watch_stops(Sequence(self.num_added + i, prompt_token_ids, p, prompt)))
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

    def _constrain(self, seq: Sequence) -> Sequence:
        """A matcher of its own for a request held to a grammar (one line for one that does not compile)."""
        if seq.params.structured is not None:
            if self._structured is None:
                if self._make_structured is None:
                    raise UsageError("`structured` outputs need the text, and this model has no tokenizer",
                                     "leave the constraint out")
                self._structured = self._make_structured()
            seq.matcher = self._structured.matcher(*seq.params.structured)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """Run one step (or finish the one queued ahead), and with the overlap queue the next decode
        step before waiting for this one's tokens."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            plan = self.scheduler.schedule()
            if not plan.seqs:
                return StepOutput(is_prefill=plan.is_prefill, seqs=[], tokens=[])
            step = self._queue_step(plan)
        # (a grammar's mask needs the token before it: a step with one is not queued ahead)
        if self.overlap and not step.counts.is_prefill and not any(s.matcher is not None for s in step.seqs):
            ahead = self.scheduler.schedule_ahead(step.seqs)
            if ahead:
                self.in_flight = self._queue_step(Schedule(ahead, [1] * len(ahead), False), after=step)
                self.num_launched_ahead += 1
        return self._finish(step)

    # --- queueing a step on the device ---------------------------------------------------------
    def _queue_step(self, plan: Schedule, after: QueuedStep | None = None) -> QueuedStep:
        """Queue the forward pass and the sampling of one step. `after`: the decode step still in
        flight whose tokens this (decode) step feeds, taken from the device."""
        counts = self._count(plan)
        seqs, chunks = plan.seqs, ([], [])
        if plan.is_prefill:  # rows whose chunk stops short of their prompt's end get no logits
            samples = plan.samples
            chunks = ([s for s, ok in zip(seqs, samples) if not ok], [n for n, ok in zip(plan.num_new, samples) if not ok])
        logits, greedy = self.runner.execute(seqs, plan.is_prefill, self._feed(seqs, after),
                                             plan.num_new if plan.is_prefill else None)
        prompt_logprobs = PromptLogprobs(self.runner.prompt_logits) if self.runner.prompt_logits else None
        if chunks[0]:
            seqs = [s for s, ok in zip(seqs, samples) if ok]
        if plan.is_prefill:  # parallel samples join their prompt's parent, and sample from its row
            seqs, rows = self.scheduler.fork(seqs)
            if rows is not None:
                index = torch.tensor(rows).to(logits.device)
                logits, greedy = logits[index], greedy[index]
        constrained = [b for b, s in enumerate(seqs) if s.matcher is not None]
        allowed = ((constrained, self._structured.allowed([seqs[b].matcher for b in constrained], logits.device))
                   if constrained else None)
        tokens, logprobs = self.sampler.sample(logits, greedy, seqs, allowed)
        host_tokens, ready = self._send_to_host(tokens, logprobs)
        return QueuedStep(counts=counts, seqs=seqs, tokens=tokens, host_tokens=host_tokens, ready=ready,
                          chunks=chunks, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _count(self, plan: Schedule) -> StepCounts:
        """The step's size and the cache's use as it is queued."""
        # a decoding row feeds the one token it generated last (a recomputed sequence's last prompt token counts too)
        num_decode = (sum(n == 1 and bool(s.output_token_ids) and s.num_cached == len(s) - 1
                          for s, n in zip(plan.seqs, plan.num_new)) if plan.is_prefill else len(plan.seqs))
        return StepCounts(is_prefill=plan.is_prefill, num_tokens=sum(plan.num_new), num_decode=num_decode,
                          used_blocks=self.cache.geometry.num_blocks - self.cache.num_free_blocks,
                          num_running=len(self.scheduler.running))

    @staticmethod
    def _feed(seqs: list[Sequence], after: QueuedStep | None) -> torch.Tensor | None:
        """The tokens a step queued ahead feeds, from the device: `seqs` are `after.seqs` less the ones
        that end with it, in order. None: the runner takes them from the sequences."""
        if after is None:
            return None
        if len(seqs) == len(after.seqs):
            return after.tokens
        row = {s.id: i for i, s in enumerate(after.seqs)}
        return after.tokens[torch.tensor([row[s.id] for s in seqs]).to(after.tokens.device, non_blocking=True)]

    @staticmethod
    def _send_to_host(tokens: torch.Tensor, logprobs) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the tokens' (and logprobs') copy to the host: pinned memory and an event to wait on,
        on a GPU; on the CPU they are there."""
        if not tokens.is_cuda:
            return tokens, None
        host, ready = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True), torch.cuda.Event()
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:
            logprobs.to_host()
        ready.record()
        return host, ready

    # --- finishing a step on the host ----------------------------------------------------------
    def _finish(self, step: QueuedStep) -> StepOutput:
        """Wait for a step's tokens; append them, finish sequences, give blocks back."""
        tokens = step.tokens_on_host()
        seqs = step.seqs
        if any(s.is_finished for s in seqs):  # ended by a stop token while this step was queued
            kept = [i for i, s in enumerate(seqs) if not s.is_finished]
            seqs, tokens = [seqs[i] for i in kept], [tokens[i] for i in kept]
        self.scheduler.advance(*step.chunks)
        _stamp_times(seqs)
        finished = self.scheduler.update(seqs, tokens)
        if step.logprobs is not None:
            step.logprobs.attach(step.seqs)
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.attach()
        finished += self._stop_strings(seqs)
        finished += self._end(structured.advance(seqs))
        self._drop_void_step_ahead()
        self.num_steps += 1
        return StepOutput(**vars(step.counts), seqs=seqs, tokens=tokens, finished=finished, prefilling=step.chunks[0])

    def _drop_void_step_ahead(self) -> None:
        if self.in_flight is not None and all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # every row of the step ahead is void: nobody waits for it

    def _end(self, seqs: list[Sequence]) -> list[Sequence]:
        """End these sequences as a stop token would (their grammar is complete)."""
        for seq in seqs:
            self.scheduler.finish(seq)
            seq.finish_reason = "stop"
        return seqs

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
        self._drop_void_step_ahead()

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


def _stamp_times(seqs: list[Sequence]) -> None:
    """When each sequence's new token reached the host (TTFT and ITL are measured from these)."""
    now = time.perf_counter()
    for seq in seqs:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
