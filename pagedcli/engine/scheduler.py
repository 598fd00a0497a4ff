"""Which sequences run this step: admission into slots, block growth, preemption, finishing.

Chunked prefill (vLLM v1's scheduler, the default): a step has a budget of
`max_num_batched_tokens` new tokens. The running sequences come first, in order of admission:
each decoding one feeds its one token, then a prompt part-way through its prefill feeds a chunk of
what is left; the waiting queue gets the rest of the budget, the last prompt admitted feeding a
chunk of its prompt only. So a long prompt is prefilled over several steps, and the decoding
sequences advance by a token in every one of them. A row whose chunk stops short of its prompt's
end samples nothing: the engine grows its `num_cached` by the chunk (`advance`). A step with a
prompt in it is prefill-kind (the attention reads the cached keys through the block table from
each row's offset); a step of decode tokens alone is decode-kind (CUDA graphs, the overlap).

Without chunked prefill a step is either a prefill (newly admitted prompts, whole, up to the budget
unless the first is longer) or a decode (one token for every running sequence), as in nano-vllm.
Continuous batching either way: a slot freed by a finished sequence is refilled from the waiting
queue at the next step.

Blocks: a prompt is admitted only when its blocks, in every layer, fit in the free list; it takes
them all at admission and fills them chunk by chunk. At decode a sequence takes new blocks only
when it crosses a block boundary; when none are free, the most recently admitted running sequence
is preempted: its blocks go back and it waits at the head of the queue to be recomputed (vLLM's
recompute preemption; a prompt part-way through its prefill starts it again), so nothing is lost
and nothing crashes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pagedcli.core.batch import NOT_FINITE
from pagedcli.core.errors import plural
from pagedcli.core.options import PROMPT_LOGPROBS_ROWS, UNCHUNKED_MAX_BATCHED_TOKENS
from pagedcli.engine.cache import KVCache
from pagedcli.engine.sequence import Sequence, Status


@dataclass
class Schedule:
    """One step: the sequences that run, how many new tokens each feeds, and the step's kind."""

    seqs: list[Sequence]
    num_new: list[int]
    is_prefill: bool  # prompt tokens in it (prefill-kind); else one decode token per sequence

    @property
    def samples(self) -> list[bool]:
        """Whether each row samples a token: its new tokens reach its end (a prompt chunk that stops
        short of the prompt's end does not)."""
        return [s.num_cached + n == len(s) for s, n in zip(self.seqs, self.num_new)]


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit to ever run: checked as the scheduler takes a request, and by
    `pagedcli serve`'s API process before it sends one to the engine's process (plain values:
    they travel between the processes)."""

    max_model_len: int
    pool_tokens: int  # tokens the whole pool holds (one layer)
    vocab_size: int | None  # None: not checked

    def why_unrunnable(self, prompt_len: int) -> str | None:
        if prompt_len == 0:
            return "the prompt is empty"
        limit = min(self.max_model_len, self.pool_tokens)
        if prompt_len + 1 > limit:
            what, hint = (("the whole pool holds", "use a larger `cache_size` or `num_blocks`") if self.pool_tokens <= limit
                          else ("the maximum length is", "shorten the prompt"))
            return (f"the prompt has {plural(prompt_len, 'token')} and needs room for {prompt_len + 1:,} with one new token, but "
                    f"{what} {limit} ({hint})")
        return None

    def unknown_token(self, token_ids: list[int]) -> str | None:
        """A token id the model has no embedding for: the tokenizer is not the model's."""
        if not self.vocab_size or not token_ids or 0 <= min(token_ids) and max(token_ids) < self.vocab_size:
            return None  # (min and max: a 128k-token prompt checked in C, not in a Python loop a token)
        bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
        return (f"token id {bad} is outside the model's vocabulary of {self.vocab_size:,} (ids 0 to "
                f"{self.vocab_size - 1:,}; ids from a tokenizer that is not this model's)")


class Scheduler:
    def __init__(self, cache: KVCache, stop_ids: set[int], max_num_batched_tokens: int | None = None,
                 vocab_size: int | None = None, chunked_prefill: bool = False):
        self.cache = cache
        self.max_model_len = cache.max_model_len
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size  # prompts with other token ids are refused (None: not checked)
        self.limits = PromptLimits(self.max_model_len, cache.geometry.pool_tokens, vocab_size)
        self.chunked_prefill = chunked_prefill
        # new tokens a step feeds at most; chunked, at least one per slot, so that no decoding sequence waits
        self.max_num_batched_tokens = max_num_batched_tokens or UNCHUNKED_MAX_BATCHED_TOKENS
        # EngineOptions refuses a smaller budget, in a line naming both settings
        assert not chunked_prefill or self.max_num_batched_tokens >= cache.max_slots, "a step budget below a token a slot"
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
                self.cache.register([parent], [len(parent)])  # (its num_cached grows in update())
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
        return self.limits.why_unrunnable(prompt_len)

    def unknown_token(self, token_ids: list[int]) -> str | None:
        return self.limits.unknown_token(token_ids)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forks)

    # --- one step -----------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """The sequences to run this step, the tokens each feeds, and the step's kind."""
        if self.chunked_prefill:
            return self._schedule_chunked()
        admitted, num_new = self._admit(self.max_num_batched_tokens)
        if admitted:
            return Schedule(admitted, num_new, True)
        running = self._grow_running()
        return Schedule(running, [1] * len(running), False)

    def _schedule_chunked(self) -> Schedule:
        """The token budget, running sequences first: a token for each decoding one, then a chunk
        for a prompt part-way through its prefill, then the waiting queue with what is left. The
        decoding ones come first in the step too: their rows are then its first tokens, which the
        CUDA backend's decode kernel serves as they lie (cuda_launch.leading_single_rows)."""
        running = self._grow_running()  # room for each one's next token, preempting from the back
        seqs = [s for s in running if not s.is_prefilling]
        num_new = [1] * len(seqs)
        budget = self.max_num_batched_tokens - len(seqs)
        for seq in running:
            if seq.is_prefilling:  # its blocks are all held since admission: only the budget limits it
                n = min(len(seq) - seq.num_cached, self._chunk_cap(seq, budget))
                if n:  # (a second prompt part-way, behind one that took the budget, waits a step)
                    seqs.append(seq)
                    num_new.append(n)
                    budget -= n
        admitted, chunks = self._admit(budget)
        seqs, num_new = seqs + admitted, num_new + chunks
        return Schedule(seqs, num_new, any(s.is_prefilling for s in seqs))

    def _admit(self, budget: int) -> tuple[list[Sequence], list[int]]:
        """Admit from the head of the queue while slots, blocks and `budget` tokens last; returns
        the admitted and the tokens each feeds now: all it has to compute, or when chunked the
        part that fits in the budget."""
        admitted, num_new = [], []
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            prefix = self._cached_prefix(seq)
            todo = len(seq) - len(prefix) * self.cache.geometry.block_size  # a preempted one recomputes its output too
            if admitted and todo > budget and not self.chunked_prefill:
                break
            if not self._fits(seq, prefix):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            slot = self.free_slots.pop(0)
            self.cache.admit(slot, len(seq), prefix)  # every block of the prompt, filled as it is computed
            seq.slot, seq.status = slot, Status.RUNNING
            seq.num_cached = len(seq) - todo  # computed already
            seq.prefill_len = len(seq)
            self.prompt_tokens += len(seq)
            self.cached_prompt_tokens += seq.num_cached
            self.running.append(seq)
            admitted.append(seq)
            num_new.append(min(todo, self._chunk_cap(seq, budget)) if self.chunked_prefill else todo)
            budget -= num_new[-1]
        return admitted, num_new

    @staticmethod
    def _chunk_cap(seq: Sequence, budget: int) -> int:
        """The tokens a prompt's chunk may have: the budget, and for prompt log-probabilities (a row
        of logits a token) at most PROMPT_LOGPROBS_ROWS."""
        return min(budget, PROMPT_LOGPROBS_ROWS) if seq.params.prompt_logprobs is not None else budget

    def _fits(self, seq: Sequence, prefix: list[np.ndarray]) -> bool:
        return self.cache.blocks_to_admit(len(seq), prefix) <= self.cache.num_free_blocks

    def _can_admit(self) -> bool:
        """Whether the next schedule() would admit the head of the queue."""
        return bool(self.waiting and self.free_slots) and self._fits(self.waiting[0],
                                                                     self._cached_prefix(self.waiting[0]))

    def _cached_prefix(self, seq: Sequence) -> list[np.ndarray]:
        """The cached blocks that begin `seq`: none for a request for prompt log-probabilities,
        since a cached token has no logits (vLLM does the same)."""
        return [] if seq.params.prompt_logprobs is not None else self.cache.cached_prefix(seq)

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
        a sequence by its length, a prompt is part-way through its prefill, or they need more free
        blocks than there are (schedule() then preempts). A stop token is only seen when the step's tokens land: the slot it frees is
        refilled a step later than without the overlap. `seqs` may hold sequences that a stop token
        has ended since they were queued: they are left out here, and their row of `seqs`' own
        step is dropped by the engine."""
        if self._can_admit() or any(s.is_prefilling for s in self.running):
            return []  # the next step admits a prompt, or goes on with a prompt's chunks
        live = [s for s in seqs if not s.is_finished]
        going_on = [s for s in live if not self._at_length_limit(s, pending=1)]
        if self.waiting and len(going_on) < len(live):
            return []  # a slot frees with this step: its waiting request is admitted right after it
        if not going_on:
            return []
        needs = [self.cache.blocks_to_write(s.slot, len(s) + 1) for s in going_on]
        if sum(needs) > self.cache.num_free_blocks:
            return []
        self.cache.prepare_writes([(seq.slot, len(seq) + 1) for seq, need in zip(going_on, needs) if need])
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
    def advance(self, seqs: list[Sequence], num_new: list[int]) -> None:
        """Rows whose prompt chunk stopped short of the prompt's end: their chunk is in the cache
        now, and nothing was sampled; the blocks it completed are offered to the prefix cache."""
        for seq, n in zip(seqs, num_new):
            seq.num_cached += n
        self.cache.register(seqs)
        self.cache.slide(seqs)

    def update(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sampled token; finish the sequences that are done. Returns those."""
        finished = []
        for seq in seqs:
            seq.num_cached = len(seq)  # everything fed this step is now in the cache
        self.cache.register(seqs)
        for seq, token in zip(seqs, tokens):
            p = seq.params
            if token == NOT_FINITE:
                seq.finish_reason = "error"
                seq.error = (f"its logits are not finite (NaN or inf) at new token {len(seq.output_token_ids) + 1}, so "
                             "it was stopped (a number overflowed: try `dtype` bfloat16 or float32, or the weights "
                             "are broken)")
            elif token in self.stop_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            else:
                seq.append_token(token)
                if self._at_length_limit(seq):
                    seq.finish_reason = "length"
            if seq.finish_reason:
                self._free(seq)
                seq.status = Status.FINISHED
                finished.append(seq)
        if finished:  # one pass over the running list, however many finished
            self.running = [s for s in self.running if not s.is_finished]
        self.cache.slide([s for s in seqs if not s.is_finished])
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

    def abort(self, seq: Sequence) -> None:
        """Finish one request now, as aborted, wherever it is: running (its slot and blocks go
        back), waiting, or a parallel sample waiting for its parent's prefill. A parent's samples
        that wait for its prefill go with it: that prefill will not come."""
        if seq.is_finished:
            return
        for child in self.forks.pop(seq.id, []):
            self.abort(child)
        for children in self.forks.values():
            if seq in children:
                children.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._free(seq)
        if seq in self.running:  # a new list: the one schedule() returned may still be a step's rows
            self.running = [s for s in self.running if s is not seq]
        seq.status = Status.FINISHED
