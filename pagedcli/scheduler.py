"""Which sequences run this step: admission into slots, block growth, preemption, finishing.

A step is either a prefill (newly admitted prompts) or a decode (one token for every running
sequence), as in nano-vllm. Continuous batching: a slot freed by a finished sequence is refilled
from the waiting queue at the next step.

Blocks: a prompt is admitted only when its blocks, in every layer, fit in the free list. At decode
a sequence takes new blocks only when it crosses a block boundary; when none are free, the most
recently admitted running sequence is preempted: its blocks go back and it waits at the head of
the queue to be recomputed (vLLM's recompute preemption), so nothing is lost and nothing crashes.
"""

from __future__ import annotations

from collections import deque

from pagedcli.cache import KVCache
from pagedcli.sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, max_slots: int, max_model_len: int, stop_ids: set[int],
                 max_prefill_tokens: int = 8192):
        self.cache = cache
        self.max_model_len = max_model_len
        self.stop_ids = stop_ids
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.free_slots = list(range(max_slots))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request, or finish it at once with an error if it could never run."""
        problem = self.why_unrunnable(len(seq.prompt_token_ids))
        if problem:
            seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", problem
            return
        self.waiting.append(seq)

    def why_unrunnable(self, prompt_len: int) -> str | None:
        if prompt_len == 0:
            return "the prompt is empty"
        geo = self.cache.geometry
        pool_tokens = (geo.num_blocks // geo.num_layers) * geo.block_size  # one sequence alone in the pool
        if prompt_len + 1 > min(self.max_model_len, pool_tokens):
            limit = min(self.max_model_len, pool_tokens)
            why = ("the whole pool holds", "use a larger --cache-size or --num-blocks") if pool_tokens <= limit else (
                "the maximum length is", "shorten the prompt")
            return f"the prompt has {prompt_len} tokens; with one new token that is more than {why[0]} {limit} ({why[1]})"
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run and whether this step is a prefill."""
        admitted = self._admit()
        if admitted:
            return admitted, True
        return self._grow_running(), False

    def _admit(self) -> list[Sequence]:
        admitted, tokens = [], 0
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            n = len(seq)  # a preempted sequence is recomputed: prompt and output so far
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            slot = self.free_slots[0]
            if not self.cache.can_hold(slot, n):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.free_slots.pop(0)
            self.cache.grow(slot, n)
            seq.slot, seq.status, seq.num_cached = slot, Status.RUNNING, 0
            self.running.append(seq)
            admitted.append(seq)
            tokens += n
        return admitted

    def _grow_running(self) -> list[Sequence]:
        """Make room for each running sequence's next token, preempting from the back if needed."""
        queue, scheduled = list(self.running), []
        while queue:
            seq = queue.pop(0)
            while not self.cache.can_hold(seq.slot, len(seq)):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.cache.grow(seq.slot, len(seq))
                scheduled.append(seq)
        self.running = scheduled
        return list(scheduled)  # a copy: finishing sequences edits self.running

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.status, seq.num_cached = Status.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.cache.release(seq.slot)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        seq.slot = None

    # --- after the forward pass ---------------------------------------------------------------
    def update(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sampled token; finish the sequences that are done. Returns those."""
        finished = []
        for seq, token in zip(seqs, tokens):
            seq.num_cached = len(seq)  # everything fed this step is now in the cache
            p = seq.params
            if token in self.stop_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            else:
                seq.output_token_ids.append(token)
                if len(seq.output_token_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
                    seq.finish_reason = "length"
            if seq.finish_reason:
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.FINISHED
