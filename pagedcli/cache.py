"""tiny-vllm's three pieces of a paged KV cache, and the snapshot that shows them.

- the pool: one tensor of `num_blocks` physical blocks (layout in `CacheGeometry`);
- the free-block list: a stack of physical block ids, with a reference count per block;
- the block table: `table[slot][layer][logical block]` -> physical block, -1 where unassigned.
  Every layer owns its own blocks, so a sequence of n blocks holds n * num_layers physical blocks.

The table lives on the CPU (numpy) and, on a GPU, in a device mirror that receives only the entries
that changed, once per step (`sync_device_table`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from pagedcli.config import CacheGeometry

UNASSIGNED = -1


class OutOfBlocks(Exception):
    """Not enough free blocks; the scheduler decides what to do (wait, or preempt)."""


class BlockAllocator:
    """A stack of free physical blocks (take from the end, give back to the end, as tiny-vllm does)
    and a reference count per block. `shuffle_seed` hands blocks out in a random order, so a kernel
    that ignores the block table cannot pass a test by luck."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None):
        self.num_blocks = num_blocks
        order = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self.free: list[int] = order
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self.free)} free")
        blocks = [self.free.pop() for _ in range(n)]
        self.ref_count[blocks] = 1
        return blocks

    def release(self, blocks) -> None:
        for b in blocks:
            assert self.ref_count[b] > 0, f"block {b} released twice"
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free.append(int(b))


class KVCache:
    """The pool, the allocator and the block table, for `max_slots` concurrent sequences."""

    def __init__(self, geometry: CacheGeometry, max_slots: int, max_model_len: int,
                 device: torch.device | str = "cpu", shuffle_seed: int | None = None):
        self.geometry = geometry
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = geometry.blocks_for(max_model_len)
        self.device = torch.device(device)
        # zeros, not empty: never-written token slots must hold finite numbers
        self.pool = torch.zeros(geometry.pool_shape, dtype=geometry.dtype, device=self.device)
        self.allocator = BlockAllocator(geometry.num_blocks, shuffle_seed)
        self.table = np.full((max_slots, geometry.num_layers, self.max_blocks_per_seq), UNASSIGNED, np.int32)
        self.num_blocks_of_slot = [0] * max_slots  # logical blocks held, the same in every layer
        self._changed: list[np.ndarray] = []  # flat table indices changed since the last device sync
        if self.device.type == "cpu":
            self.device_table = torch.from_numpy(self.table)  # shares memory: nothing to sync
        else:
            self.device_table = torch.full(self.table.shape, UNASSIGNED, dtype=torch.int32, device=self.device)

    # --- allocation -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, slot: int, num_tokens: int) -> int:
        """Physical blocks (all layers) the slot must take to hold `num_tokens` tokens."""
        new_logical = self.geometry.blocks_for(num_tokens) - self.num_blocks_of_slot[slot]
        return max(new_logical, 0) * self.geometry.num_layers

    def can_hold(self, slot: int, num_tokens: int) -> bool:
        return self.blocks_needed(slot, num_tokens) <= self.num_free_blocks

    def grow(self, slot: int, num_tokens: int) -> None:
        """Give `slot` blocks for `num_tokens` tokens in every layer; raises OutOfBlocks, changing nothing."""
        have = self.num_blocks_of_slot[slot]
        want = self.geometry.blocks_for(num_tokens)
        if want <= have:
            return
        blocks = self.allocator.allocate((want - have) * self.geometry.num_layers)
        self.table[slot, :, have:want] = np.asarray(blocks, np.int32).reshape(self.geometry.num_layers, want - have)
        self.num_blocks_of_slot[slot] = want
        self._mark_changed(slot, have, want)

    def release(self, slot: int) -> None:
        """A finished (or preempted) sequence gives every block back."""
        n = self.num_blocks_of_slot[slot]
        if n:
            self.allocator.release(self.table[slot, :, :n].ravel().tolist())
        self.table[slot, :, :n] = UNASSIGNED
        self.num_blocks_of_slot[slot] = 0
        self._mark_changed(slot, 0, n)

    def blocks_of(self, slot: int, layer: int) -> list[int]:
        return self.table[slot, layer, : self.num_blocks_of_slot[slot]].tolist()

    # --- the device mirror ----------------------------------------------------------------
    def _mark_changed(self, slot: int, start: int, stop: int) -> None:
        if self.device.type == "cpu" or stop <= start:
            return
        _, layers, width = self.table.shape
        rows = slot * layers * width + np.arange(layers)[:, None] * width
        self._changed.append((rows + np.arange(start, stop)[None, :]).ravel())

    def sync_device_table(self) -> None:
        """Copy the table entries that changed since the last call to the device mirror: one small
        host-to-device copy per step, instead of tiny-vllm's whole table for every layer."""
        if not self._changed:
            return
        index = np.concatenate(self._changed)
        self._changed.clear()
        packed = np.stack([index, self.table.ravel()[index].astype(np.int64)])
        packed = torch.from_numpy(packed).to(self.device)
        self.device_table.view(-1)[packed[0]] = packed[1].to(torch.int32)
