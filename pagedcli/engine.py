"""The engine: requests in, tokens out, one step at a time.

    step():  scheduler.schedule()  -> which sequences run, prefill or decode
             runner.run()          -> the forward pass over the paged cache: logits
             sampler.sample()      -> one token per sequence
             scheduler.update()    -> append, finish, give blocks back

Each step returns a StepOutput saying what happened, which the CLI streams, the live view
draws and the benchmark times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedcli.cache import KVCache
from pagedcli.runner import ModelRunner
from pagedcli.sampler import sample
from pagedcli.scheduler import Scheduler
from pagedcli.sequence import SamplingParams, Sequence
from pagedcli.snapshot import CacheSnapshot, take_snapshot


@dataclass
class StepOutput:
    is_prefill: bool
    seqs: list[Sequence]  # the sequences that ran
    tokens: list[int]  # the token each sampled (a stop token is sampled but not appended)
    finished: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0  # tokens fed through the network
    elapsed: float = 0.0  # seconds
    used_blocks: int = 0  # blocks in use during the step (before finished sequences give theirs back)
    num_running: int = 0  # sequences holding a slot during the step


class Engine:
    def __init__(self, runner: ModelRunner, cache: KVCache, stop_ids):
        self.runner = runner
        self.cache = cache  # its max_slots and max_model_len are the engine's
        self.scheduler = Scheduler(cache, set(stop_ids))
        self.sequences: list[Sequence] = []
        self.num_steps = 0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        seq = Sequence(len(self.sequences), prompt_token_ids, params, prompt)
        self.sequences.append(seq)
        self.scheduler.add(seq)
        return seq

    def add_parallel(self, prompt_token_ids: list[int], params: list[SamplingParams],
                     prompt: str | None = None) -> list[Sequence]:
        """`len(params)` samples of one prompt that share its blocks (copy-on-write)."""
        seqs = [Sequence(len(self.sequences) + i, prompt_token_ids, p, prompt) for i, p in enumerate(params)]
        self.sequences.extend(seqs)
        self.scheduler.add_parallel(seqs[0], seqs[1:])
        return seqs

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        start = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return StepOutput(is_prefill, [], [])
        num_tokens = sum(len(s) - s.num_cached for s in seqs) if is_prefill else len(seqs)
        used_blocks = self.cache.geometry.num_blocks - self.cache.num_free_blocks
        num_running = len(self.scheduler.running)
        logits = self.runner.run(seqs, is_prefill)
        if is_prefill:
            seqs, logits = self.scheduler.fork(seqs, logits)
        tokens = sample(logits, seqs, self.runner.model.backend.argmax)
        now = time.perf_counter()
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
        finished = self.scheduler.update(seqs, tokens)
        self.num_steps += 1
        return StepOutput(is_prefill, seqs, tokens, finished, num_tokens, now - start, used_blocks, num_running)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
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
        self.num_steps = 0
        self.scheduler.num_preemptions = 0
        self.scheduler.prompt_tokens = self.scheduler.cached_prompt_tokens = 0
        self.cache.num_copied_blocks = 0
        self.cache.forget_cached_prefixes()

    def abort_all(self) -> None:
        """Finish every unfinished request now (Ctrl-C): every block goes back."""
        forked = [c for children in self.scheduler.forks.values() for c in children]
        self.scheduler.forks.clear()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + forked:
            seq.finish_reason = seq.finish_reason or "abort"
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()

    def snapshot(self) -> CacheSnapshot:
        return take_snapshot(self)
