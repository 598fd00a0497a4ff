"""An immutable picture of the cache at one step, for the live view and inspect-cache.

It holds plain Python values only (copied from the engine's host-side state), never device
tensors, so reading it can neither slow nor change the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedcli.core.geometry import CacheGeometry
from pagedcli.core.parallel import RankView


@dataclass(frozen=True)
class SlotView:
    slot: int
    seq_id: int
    prompt: str | None
    num_prompt_tokens: int
    token_ids: tuple[int, ...]  # prompt + output so far
    num_cached: int  # tokens whose K/V are in the cache
    table: tuple[tuple[int, ...], ...]  # [layer][logical block] -> physical block; -1: given back (window)
    num_output_tokens: int
    tokens_per_s: float
    num_preemptions: int
    prefill_len: int = 0  # part-way through its prefill: the tokens it computes before it samples; else 0
    request_id: str | None = None  # the client's name for the request (serve)

    @property
    def is_prefilling(self) -> bool:
        """Its prefill is part-way (chunked prefill): `num_cached` of `prefill_len` computed."""
        return self.num_cached < self.prefill_len

    @property
    def num_blocks(self) -> int:
        """Logical blocks, the same count in every layer (those given back included)."""
        return len(self.table[0]) if self.table else 0

    @property
    def num_released(self) -> int:
        """Logical blocks at the start given back behind a sliding window (-1 in the table)."""
        return next((i for i, b in enumerate(self.table[0]) if b >= 0), self.num_blocks) if self.table else 0

    @property
    def num_held(self) -> int:
        """Logical blocks the slot holds: its blocks less those given back."""
        return self.num_blocks - self.num_released

    def fill(self, logical: int, block_size: int) -> int:
        """Tokens written into logical block `logical`."""
        return max(0, min(block_size, self.num_cached - logical * block_size))


@dataclass(frozen=True)
class WaitingView:
    seq_id: int
    prompt: str | None
    num_tokens: int
    num_preemptions: int
    request_id: str | None = None


@dataclass(frozen=True)
class CacheSnapshot:
    step: int
    geometry: CacheGeometry
    num_free_blocks: int
    slots: tuple[SlotView, ...]  # running sequences, by slot
    waiting: tuple[WaitingView, ...]
    num_finished: int  # ended by the engine (a stop token, the length limit, an error), not aborted
    num_preemptions: int
    max_slots: int
    max_model_len: int
    prefix_hit_rate: float = 0.0  # prompt tokens served from cached blocks / prompt tokens admitted
    num_copied_blocks: int = 0  # copy-on-write copies so far
    num_aborted: int = 0  # ended by abort_all (Ctrl-C) or abort (a client gone): cut short, or never run
    sliding_window: int | None = None  # the model's (Mistral's): blocks behind it are given back
    num_window_freed: int = 0  # blocks (all layers) given back behind sliding windows so far
    weights: str = ""  # the weights' format for people (Weights.format): bfloat16, int4 (group 128, asymmetric), Q4_K
    # tensor parallelism: what each rank holds of every block (its KV heads, in a pool of its own at the
    # same offsets; `geometry` is one rank's); () on one device
    ranks: tuple[RankView, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.geometry.num_blocks - self.num_free_blocks

    def slot(self, slot: int) -> SlotView | None:
        return next((s for s in self.slots if s.slot == slot), None)

    @property
    def contiguous_tokens(self) -> int:
        """Token slots (one layer) a contiguous cache reserving the maximum length per running
        sequence would hold: the PagedAttention paper's comparison."""
        return len(self.slots) * self.max_model_len


def take_snapshot(engine) -> CacheSnapshot:
    cache, sched = engine.cache, engine.scheduler
    slots = []
    for seq in sorted(sched.running, key=lambda s: s.slot):
        n = cache.num_blocks_of_slot[seq.slot]
        table = tuple(tuple(row) for row in cache.table[seq.slot, :, :n].tolist())
        elapsed = (seq.token_times[-1] - seq.token_times[0]) if len(seq.token_times) > 1 else 0.0
        rate = (len(seq.token_times) - 1) / elapsed if elapsed > 0 else 0.0
        slots.append(SlotView(seq.slot, seq.id, seq.prompt, len(seq.prompt_token_ids), tuple(seq.token_ids),
                              seq.num_cached, table, len(seq.output_token_ids), rate, seq.num_preemptions,
                              seq.prefill_len if seq.is_prefilling else 0, seq.request_id))
    waiting = tuple(WaitingView(s.id, s.prompt, len(s), s.num_preemptions, s.request_id) for s in sched.waiting)
    aborted = sum(1 for s in engine.sequences if s.finish_reason == "abort") + engine.num_forgotten["aborted"]
    finished = sum(1 for s in engine.sequences if s.is_finished and s.finish_reason != "abort") \
        + engine.num_forgotten["finished"]
    return CacheSnapshot(engine.num_steps, cache.geometry, cache.num_free_blocks, tuple(slots), waiting,
                         finished, sched.num_preemptions, cache.max_slots, cache.max_model_len,
                         sched.prefix_hit_rate, cache.num_copied_blocks, aborted, cache.sliding_window,
                         cache.num_window_freed, engine.runner.model.w.format, engine.runner.ranks)
