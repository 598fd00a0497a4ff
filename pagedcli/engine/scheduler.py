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

from pagedcli.engine.cache import KVCache
from pagedcli.backends import NOT_FINITE
from pagedcli.engine.sequence import Sequence, Status
from pagedcli.errors import plural


class Scheduler:
    def __init__(self, cache: KVCache, stop_ids: set[int], max_prefill_tokens: int = 8192,
                 vocab_size: int | None = None):
        self.cache = cache
        self.max_model_len = cache.max_model_len
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size  # prompts with other token ids are refused (None: not checked)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.free_slots = list(range(cache.max_slots))
        self.num_preemptions = 0
        self.forks: dict[int, list[Sequence]] = {}  # parent id -> parallel samples waiting to share its blocks
        self.prompt_tokens = 0  # prompt tokens admitted (recomputations included)
        self.cached_prompt_tokens = 0  # of those, served from cached prefix blocks

    def add(self, seq: Sequence) -> None:
        """Queue a request, or finish it at once with an error if it could never run."""
        problem = self.why_unrunnable(len(seq.prompt_token_ids)) or self.unknown_token(seq.prompt_token_ids)
        if problem:
            seq.status, seq.finish_reason, seq.error = Status.FINISHED, "error", problem
            return
        self.waiting.append(seq)

    def add_parallel(self, parent: Sequence, children: list[Sequence]) -> None:
        """Parallel samples of one prompt: the parent runs the prefill, the children then share all
        its blocks (`fork`) and copy a shared block only when they write into it."""
        self.add(parent)
        for child in children:
            if parent.error:
                child.status, child.finish_reason, child.error = Status.FINISHED, "error", parent.error
        if not parent.error:
            self.forks[parent.id] = list(children)

    def fork(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """After a prefill: each prefilled parent's children take a slot and share the parent's
        blocks. Returns the sequences that sample now, `seqs` and then the children that joined,
        and for each the row of `seqs` whose logits it samples from (None: nobody joined, the
        rows are `seqs`' own). Children without a free slot wait at the head of the queue (and
        find the prompt's full blocks in the prefix cache)."""
        joined, rows = [], []
        for row, parent in enumerate(seqs):
            children = self.forks.pop(parent.id, [])
            if children:  # the prompt's full blocks, offered once and hashed once for all samples
                self.cache.register(parent.slot, parent, len(parent))
            for child in children:
                child.block_hashes = list(parent.block_hashes)
                if not self.free_slots:
                    self.waiting.appendleft(child)
                    continue
                child.slot, child.status = self.free_slots.pop(0), Status.RUNNING
                self.cache.fork(parent.slot, child.slot)
                self.prompt_tokens += len(child)
                self.cached_prompt_tokens += len(child)
                self.running.append(child)
                joined.append(child)
                rows.append(row)
        if not joined:
            return seqs, None
        return seqs + joined, list(range(len(seqs))) + rows

    def why_unrunnable(self, prompt_len: int) -> str | None:
        if prompt_len == 0:
            return "the prompt is empty"
        pool_tokens = self.cache.geometry.pool_tokens
        limit = min(self.max_model_len, pool_tokens)
        if prompt_len + 1 > limit:
            what, hint = (("the whole pool holds", "use a larger `cache_size` or `num_blocks`") if pool_tokens <= limit
                          else ("the maximum length is", "shorten the prompt"))
            return (f"the prompt has {plural(prompt_len, 'token')} and needs room for {prompt_len + 1} with one new token, but "
                    f"{what} {limit} ({hint})")
        return None

    def unknown_token(self, token_ids: list[int]) -> str | None:
        """A token id the model has no embedding for: the tokenizer is not the model's."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None) if self.vocab_size else None
        if bad is None:
            return None
        return (f"token id {bad} is outside the model's vocabulary of {self.vocab_size} "
                "(the model folder's tokenizer does not match its weights)")

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forks)

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
            prefix = self.cache.cached_prefix(seq)
            if not self._fits(seq, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            slot = self.free_slots.pop(0)
            self.cache.admit(slot, n, prefix)
            seq.slot, seq.status = slot, Status.RUNNING
            seq.num_cached = len(prefix) * self.cache.geometry.block_size  # computed already
            self.prompt_tokens += n
            self.cached_prompt_tokens += seq.num_cached
            self.running.append(seq)
            admitted.append(seq)
            tokens += n
        return admitted

    def _fits(self, seq: Sequence, prefix: list[tuple[int, ...]]) -> bool:
        return self.cache.blocks_to_admit(len(seq), prefix) <= self.cache.num_free_blocks

    def _can_admit(self) -> bool:
        """Whether the next schedule() would admit the head of the queue."""
        return bool(self.waiting and self.free_slots) and self._fits(self.waiting[0],
                                                                     self.cache.cached_prefix(self.waiting[0]))

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from cached blocks over all prompt tokens admitted."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _grow_running(self) -> list[Sequence]:
        """Make room for each running sequence's next token, preempting from the back if needed."""
        queue, scheduled = deque(self.running), []
        while queue:
            seq = queue.popleft()
            n = len(seq)
            while (need := self.cache.blocks_to_write(seq.slot, n)) > self.cache.num_free_blocks:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                if need:
                    self.cache.prepare_write(seq.slot, n)
                scheduled.append(seq)
        self.running = scheduled
        return scheduled

    def schedule_ahead(self, seqs: list[Sequence]) -> list[Sequence]:
        """The decode step after `seqs` (a decode step whose tokens are not on the host yet), planned
        now: the sequences that go on whatever token they get, each with room for one token more
        than it holds now (the engine's overlap). Empty, and no block taken, when the next step
        is not a plain decode of them: a waiting request can be admitted now or once this step ends
        a sequence by its length, or they need more free blocks than there are (schedule() then
        preempts). A stop token is only seen when the step's tokens land: the slot it frees is
        refilled a step later than without the overlap. `seqs` may hold sequences that a stop token
        has ended since they were queued: they are left out here, and their row of `seqs`' own
        step is dropped by the engine."""
        if self._can_admit():
            return []
        live = [s for s in seqs if not s.is_finished]
        going_on = [s for s in live if not self._at_length_limit(s, pending=1)]
        if self.waiting and len(going_on) < len(live):
            return []  # a slot frees with this step: its waiting request is admitted right after it
        if not going_on:
            return []
        needs = [self.cache.blocks_to_write(s.slot, len(s) + 1) for s in going_on]
        if sum(needs) > self.cache.num_free_blocks:
            return []
        for seq, need in zip(going_on, needs):
            if need:
                self.cache.prepare_write(seq.slot, len(seq) + 1)
        return going_on

    def _at_length_limit(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether the sequence is as long as it may get, once `pending` more tokens are appended."""
        return (len(seq.output_token_ids) + pending >= seq.params.max_tokens
                or len(seq) + pending >= self.max_model_len)

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
            self.cache.register(seq.slot, seq, seq.num_cached)
            p = seq.params
            if token == NOT_FINITE:
                seq.finish_reason = "error"
                seq.error = (f"its logits are not finite (NaN or inf) at new token {len(seq.output_token_ids) + 1}, so "
                             "it was stopped (a number overflowed: try `dtype` bfloat16 or float32, or the weights "
                             "are broken)")
            elif token in self.stop_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            else:
                seq.output_token_ids.append(token)
                if self._at_length_limit(seq):
                    seq.finish_reason = "length"
            if seq.finish_reason:
                self._free(seq)
                seq.status = Status.FINISHED
                finished.append(seq)
        if finished:  # one pass over the running list, however many finished
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def reset(self) -> None:
        """Zero the counters (between runs: nothing is unfinished)."""
        self.num_preemptions = 0
        self.prompt_tokens = self.cached_prompt_tokens = 0

    def abort_all(self) -> None:
        """Finish every unfinished request now, as aborted: every slot and block goes back."""
        forked = [c for children in self.forks.values() for c in children]
        self.forks.clear()
        for seq in list(self.running) + list(self.waiting) + forked:
            seq.finish_reason = seq.finish_reason or "abort"
            self.finish(seq)
        self.waiting.clear()

    def finish(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.FINISHED
