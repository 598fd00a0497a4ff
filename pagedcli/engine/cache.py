"""tiny-vllm's three pieces of a paged KV cache:

- the pool: one tensor of `num_blocks` physical blocks (layout in `CacheGeometry`), on the device
  (core/kv_store.py: `KVCache.store`);
- the free-block list: physical block ids, with a reference count per block;
- the block table: `table[slot][layer][logical block]` -> physical block, -1 where unassigned.
  Every layer owns its own blocks, so a sequence of n blocks holds n * num_layers physical blocks.

Beyond tiny-vllm, blocks can be shared: a prompt reuses the cached blocks of a prefix seen before
(`prefix_cache.py`), and parallel samples share their prompt's blocks (`fork`), copying a shared
block only before writing into it (copy-on-write). With a sliding window (Mistral's), a block that
every later token of its sequence attends past is given back (`slide`, as vLLM frees them): its
table entries become -1 behind the blocks still read, so a long sequence holds at most
window / block_size + 1 blocks a layer.

An fp8 pool (`geometry.kv_fp8`) holds e4m3 values, with `store.kv_scales` (core/fp8.py: float32
[num_layers, num_kv_heads] for K and for V) beside it; blocks are copied and shared as raw bytes,
so prefix caching and copy-on-write need nothing of their own.

The table lives on the CPU (numpy) and, on a GPU, in a device mirror that receives only the entries
that changed, once per step (`sync_device_table`).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from pagedcli.core.fp8 import KVScales
from pagedcli.core.geometry import CacheGeometry
from pagedcli.core.kv_store import KVStore
from pagedcli.engine.prefix_cache import PrefixCache, extend_block_hashes

UNASSIGNED = -1


class BlockAllocator:
    """The free blocks and a reference count per block.

    tiny-vllm's free list is a stack (the block freed last is taken first). Ours is a queue: blocks
    are taken least recently freed first, so a freed block that still holds a cached prefix
    survives as long as possible (prefix caching's LRU eviction). `shuffle_seed` hands blocks out
    in a random order, so a kernel that ignores the block table cannot pass a test by luck.

    Every call takes or gives a whole sequence's blocks at once (a block per layer: an 8,000-token
    prompt of Llama-3.2-1B is 8,000 blocks), so each is a few numpy operations, not a loop over
    the blocks in Python (which held up every running sequence for several steps' time whenever
    a long one finished or was admitted: docs/performance-log.md, "A mixed step's decoding rows,
    and the host's bookkeeping of long prompts"). The queue is an array of block ids in
    the order they were freed, read from `head` and appended at `tail`; a block that leaves the
    free list for another reason (a cached prefix shared again) keeps its entry, which is then
    stale: an entry counts only while its block is free and it is the block's latest (`position`).
    Stale entries are squeezed out when the array fills. Arrays, not a Python container of the
    blocks: a pool sized to a large GPU holds millions, and a container of them is walked at every
    full garbage collection, long enough that the engine queues nothing meanwhile
    (docs/performance-log.md, "The host's own work"). A block is free exactly when its
    reference count is 0."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None, on_reuse=None):
        self.num_blocks = num_blocks
        if shuffle_seed is None:
            order = np.arange(num_blocks, dtype=np.int32)
        else:
            shuffled = list(range(num_blocks))
            random.Random(shuffle_seed).shuffle(shuffled)
            order = np.asarray(shuffled, dtype=np.int32)
        self.queue = np.empty(2 * num_blocks + 1, dtype=np.int32)  # room for as many stale entries as live ones
        self.queue[:num_blocks] = order
        self.position = np.empty(num_blocks, dtype=np.int64)  # each block's latest entry in the queue
        self.position[order] = np.arange(num_blocks)
        self.head, self.tail = 0, num_blocks
        self.num_free = num_blocks
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.on_reuse = on_reuse  # told of the blocks handed out, so that stale prefix entries are dropped

    def _live(self, start: int, stop: int) -> np.ndarray:
        """Which entries of queue[start:stop] stand for a free block."""
        blocks = self.queue[start:stop]
        return (self.ref_count[blocks] == 0) & (self.position[blocks] == np.arange(start, stop))

    @property
    def free(self) -> list[int]:
        """The free blocks, least recently freed first (for checks)."""
        return self.queue[self.head:self.tail][self._live(self.head, self.tail)].tolist()

    def allocate(self, n: int) -> list[int]:
        if not 0 <= n <= self.num_free:
            # the scheduler asks only for blocks it has counted free: reaching this is a bug
            raise RuntimeError(f"{n} blocks asked, {self.num_free} free")
        taken, need = [], n
        while need:  # a window of the queue at a time: stale entries in it are passed over
            stop = min(self.tail, self.head + max(2 * need, 64))
            live = np.flatnonzero(self._live(self.head, stop))[:need]
            taken.append(self.queue[self.head + live])
            need -= live.shape[0]
            self.head = self.head + int(live[-1]) + 1 if need == 0 else stop
        blocks = np.concatenate(taken) if taken else np.empty(0, np.int32)
        self.num_free -= n
        self.ref_count[blocks] = 1
        if self.on_reuse is not None:
            self.on_reuse(blocks)
        return blocks.tolist()

    def share(self, blocks) -> None:
        """One more owner for each block (a cached prefix or a forked sequence); a block that was
        free leaves the free list (its queue entry goes stale)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        self.num_free -= len(np.unique(blocks[self.ref_count[blocks] == 0]))
        np.add.at(self.ref_count, blocks, 1)

    def release(self, blocks) -> None:
        """One owner less for each block; those left with none join the free list's end, in the
        order given."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if not blocks.size:
            return
        ids, times = np.unique(blocks, return_counts=True)
        if ids[0] < 0 or (self.ref_count[ids] < times).any():  # a bug: say which, as an assert would
            bad = ids[(ids < 0) | (self.ref_count[ids] < times)][0]
            raise AssertionError(f"block {bad} released twice, or not a block")
        self.ref_count[ids] -= times.astype(np.int32)
        freed = blocks[self.ref_count[blocks] == 0]
        if len(ids) < len(blocks):  # a block given twice joins once, where its count reached 0: its last
            _, last = np.unique(freed[::-1], return_index=True)
            freed = freed[np.sort(len(freed) - 1 - last)]
        if self.tail + len(freed) > len(self.queue):
            self._squeeze()
        self.queue[self.tail:self.tail + len(freed)] = freed
        self.position[freed] = np.arange(self.tail, self.tail + len(freed))
        self.tail += len(freed)
        self.num_free += len(freed)

    def _squeeze(self) -> None:
        """Drop the stale entries: the free blocks, in order, from the queue's start."""
        live = self.queue[self.head:self.tail][self._live(self.head, self.tail)]
        self.queue[:len(live)] = live
        self.position[live] = np.arange(len(live))
        self.head, self.tail = 0, len(live)


class KVCache:
    """The host's side of the cache for `max_slots` concurrent sequences: the allocator, the block
    table and the prefix cache; `store` is the device side (the pool, the table's device mirror,
    an fp8 pool's scales: core/kv_store.py), which the backends read and write."""

    def __init__(self, geometry: CacheGeometry, max_slots: int, max_model_len: int,
                 device: torch.device | str = "cpu", shuffle_seed: int | None = None, prefix_caching: bool = True,
                 kv_scales: KVScales | None = None, sliding_window: int | None = None, mirrors: bool = False):
        """`mirrors`: other copies of the table follow this one (tensor parallelism's other ranks,
        from the changes `sync_device_table` returns), on the CPU too."""
        self.geometry = geometry
        self.sliding_window = sliding_window  # a token attends to this many positions, itself included
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = geometry.blocks_for(max_model_len)
        self.device = torch.device(device)
        self.table = np.full((max_slots, geometry.num_layers, self.max_blocks_per_seq), UNASSIGNED, np.int32)
        self.store = KVStore(geometry, self.table, max_model_len, self.device, kv_scales)
        self.prefix_cache = PrefixCache(geometry.num_blocks) if prefix_caching else None
        self.allocator = BlockAllocator(geometry.num_blocks, shuffle_seed,
                                        on_reuse=self.prefix_cache.forget if prefix_caching else None)
        self.num_blocks_of_slot = [0] * max_slots  # logical blocks held, the same in every layer
        self.num_offered = [0] * max_slots  # the slot's full blocks offered to the prefix cache so far
        self.shares_tail = [False] * max_slots  # the slot's partial last block may be shared (after a fork)
        self.pending_copies: list[tuple[np.ndarray, list[int]]] = []  # copy-on-write: (from, to) blocks
        self.num_copied_blocks = 0  # copy-on-write copies so far (all layers)
        self.num_slid = [0] * max_slots  # the slot's logical blocks given back behind its sliding window
        self.num_window_freed = 0  # blocks (all layers) given back behind sliding windows so far
        self._changed: list[tuple[int, int, int]] = []  # (slot, start, stop) of blocks changed since the last device sync
        self.tracks_changes = mirrors or not self.store.mirrors_host

    # --- allocation -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, slot: int, num_tokens: int) -> int:
        """Physical blocks (all layers) the slot must take to hold `num_tokens` tokens."""
        new_logical = self.geometry.blocks_for(num_tokens) - self.num_blocks_of_slot[slot]
        return max(new_logical, 0) * self.geometry.num_layers

    def grow(self, slot: int, num_tokens: int) -> None:
        """Give `slot` blocks for `num_tokens` tokens in every layer; raises RuntimeError (a bug: the scheduler counts first), changing nothing."""
        self.grow_many([(slot, num_tokens)])

    def grow_many(self, requests: list[tuple[int, int]]) -> None:
        """grow() for each (slot, num_tokens), each slot at most once, the blocks taken in one go:
        at a block boundary a decode step grows every sequence that crosses it (16 blocks each at
        Llama-3.2-1B), and taken one sequence at a time the host's work kept the GPU waiting
        (docs/performance-log.md, "The host at a block boundary")."""
        layers, spans = self.geometry.num_layers, []
        for slot, num_tokens in requests:
            have, want = self.num_blocks_of_slot[slot], self.geometry.blocks_for(num_tokens)
            if want > have:
                spans.append((slot, have, want))
        if not spans:
            return
        blocks = np.asarray(self.allocator.allocate(sum(want - have for _, have, want in spans) * layers), np.int32)
        at = 0
        for slot, have, want in spans:  # in order: each slot gets the blocks a grow() of its own would
            n = (want - have) * layers
            self.table[slot, :, have:want] = blocks[at:at + n].reshape(layers, want - have)
            at += n
            self.num_blocks_of_slot[slot] = want
            self._mark_changed(slot, have, want)

    def release(self, slot: int) -> None:
        """A finished (or preempted) sequence gives every block back (shared ones lose one owner)."""
        n, slid = self.num_blocks_of_slot[slot], self.num_slid[slot]
        if n > slid:
            self.allocator.release(self.table[slot, :, slid:n].ravel())
        self.table[slot, :, :n] = UNASSIGNED
        self.num_blocks_of_slot[slot] = self.num_slid[slot] = 0
        self.num_offered[slot] = 0
        self.shares_tail[slot] = False
        self._mark_changed(slot, 0, n)

    # --- prefix caching -------------------------------------------------------------------
    # `seq` below is a Sequence: its token_ids, and block_hashes, the memo of their block hashes.
    def cached_prefix(self, seq) -> list[np.ndarray]:
        """Rows (a physical block per layer) of the cached full blocks that begin `seq`'s tokens;
        never all of them, since the last token must be computed to give the next token's logits."""
        if self.prefix_cache is None:
            return []
        limit = (len(seq) - 1) // self.geometry.block_size
        if len(seq.block_hashes) < limit:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.geometry.block_size, limit)
        return self.prefix_cache.lookup(seq.block_hashes, limit)

    def blocks_to_admit(self, num_tokens: int, prefix: list[np.ndarray]) -> int:
        """Free blocks that admitting a sequence with this cached prefix uses up: new blocks for
        the rest, and the cached ones that sit in the free list (unowned, kept for reuse)."""
        new = (self.geometry.blocks_for(num_tokens) - len(prefix)) * self.geometry.num_layers
        return new + (int((self.allocator.ref_count[np.asarray(prefix)] == 0).sum()) if prefix else 0)

    def admit(self, slot: int, num_tokens: int, prefix: list[np.ndarray]) -> None:
        """Give a fresh slot its cached prefix blocks (shared) and new blocks for the rest."""
        if prefix:
            rows = np.stack(prefix)  # [blocks, layers]
            self.allocator.share(rows.ravel())
            self.table[slot, :, :len(prefix)] = rows.T
        self.num_blocks_of_slot[slot] = len(prefix)
        self._mark_changed(slot, 0, len(prefix))
        self.num_offered[slot] = len(prefix)  # found in the cache: nothing to offer
        self.grow(slot, num_tokens)

    def reset(self) -> None:
        """Forget the cached prefixes and zero the counters (between runs: every slot is free)."""
        self.num_copied_blocks = 0
        if self.prefix_cache is not None:
            self.prefix_cache = PrefixCache(self.geometry.num_blocks)
            self.allocator.on_reuse = self.prefix_cache.forget
            self.num_offered = [0] * self.max_slots

    def register(self, seqs: list, cached: list[int] | None = None) -> None:
        """Offer the full blocks each sequence completed (of its first `cached` tokens, default its
        `num_cached`, which are in its slot's blocks) to the prefix cache, all in one call: at a
        block boundary every sequence of a decode step completes one."""
        if self.prefix_cache is None:
            return
        size, offered = self.geometry.block_size, self.num_offered
        hashes, rows = [], []
        for seq, num_cached in zip(seqs, cached or [s.num_cached for s in seqs]):
            slot, full = seq.slot, num_cached // size
            done = offered[slot]
            if full <= done:
                continue  # the common case: no block was completed
            if len(seq.block_hashes) < full:
                extend_block_hashes(seq.block_hashes, seq.token_ids, size, full)
            hashes += seq.block_hashes[done:full]
            rows.append(self.table[slot, :, done:full].T)
            offered[slot] = full
        if hashes:
            self.prefix_cache.insert(hashes, np.concatenate(rows))

    # --- a sliding window ---------------------------------------------------------------------
    def slide(self, seqs: list) -> None:
        """Give back each sequence's blocks that its sliding window has passed, all in one call: the
        next token (at position `num_cached`) and every later one attend only to positions past
        num_cached - window, so a block wholly before that is read no more. A cached prefix's
        block keeps its content until it is taken again (the prefix cache was offered it first:
        register() runs before this)."""
        window, size = self.sliding_window, self.geometry.block_size
        if not window:
            return
        spans = []
        for seq in seqs:
            slot = seq.slot
            read_from = max(seq.num_cached - window + 1, 0) // size  # the first block a later token reads
            if read_from > self.num_slid[slot]:
                spans.append((slot, self.num_slid[slot], read_from))
        if not spans:
            return
        self.allocator.release(np.concatenate([self.table[slot, :, a:b].ravel() for slot, a, b in spans]))
        for slot, a, b in spans:
            self.table[slot, :, a:b] = UNASSIGNED
            self.num_slid[slot] = b
            self.num_window_freed += (b - a) * self.geometry.num_layers
            self._mark_changed(slot, a, b)

    # --- sharing between sequences: fork and copy-on-write ----------------------------------
    def fork(self, parent: int, child: int) -> None:
        """`child` shares every block of `parent` (parallel samples of one prompt)."""
        n, slid = self.num_blocks_of_slot[parent], self.num_slid[parent]
        self.allocator.share(self.table[parent, :, slid:n].ravel())
        self.table[child, :, :n] = self.table[parent, :, :n]
        self.num_blocks_of_slot[child], self.num_slid[child] = n, slid
        self.num_offered[child] = self.num_offered[parent]
        self.shares_tail[parent] = self.shares_tail[child] = True
        self._mark_changed(child, 0, n)

    def _write_block_is_shared(self, slot: int, num_tokens: int) -> bool:
        """Only a fork shares a block that is still being written (a cached prefix is full blocks,
        never written again), so other slots skip the reference-count look-up."""
        if not self.shares_tail[slot]:
            return False
        last = (num_tokens - 1) // self.geometry.block_size  # the block the newest token goes into
        if last >= self.num_blocks_of_slot[slot]:
            self.shares_tail[slot] = False  # a new block: private from here on
            return False
        shared = bool((self.allocator.ref_count[self.table[slot, :, last]] > 1).any())
        self.shares_tail[slot] = shared
        return shared

    def blocks_to_write(self, slot: int, num_tokens: int) -> int:
        """Free blocks needed before the slot writes its token number `num_tokens`: a new block
        at a block boundary, or a private copy of a shared partial block; mostly none."""
        if (num_tokens - 1) % self.geometry.block_size and not self.shares_tail[slot]:
            return 0  # the common case, checked first: the token goes into a block the slot owns
        cow = self.geometry.num_layers if self._write_block_is_shared(slot, num_tokens) else 0
        return self.blocks_needed(slot, num_tokens) + cow

    def prepare_write(self, slot: int, num_tokens: int) -> None:
        """Copy-on-write, then grow: afterwards the slot owns the block its newest token goes into."""
        self.prepare_writes([(slot, num_tokens)])

    def prepare_writes(self, writes: list[tuple[int, int]]) -> None:
        """prepare_write() for each (slot, num_tokens) in turn, each slot at most once: the new
        blocks of the writes between two copies-on-write (rare: a fork's shared last block) taken in
        one go (grow_many), so that every slot gets the blocks it would one write at a time."""
        growing = []
        for slot, num_tokens in writes:
            if self._write_block_is_shared(slot, num_tokens):
                self.grow_many(growing)
                growing = []
                last = (num_tokens - 1) // self.geometry.block_size
                shared = self.table[slot, :, last].copy()
                private = self.allocator.allocate(self.geometry.num_layers)
                self.pending_copies.append((shared, private))
                self.num_copied_blocks += len(private)
                self.table[slot, :, last] = private
                self._mark_changed(slot, last, last + 1)
                self.allocator.release(shared)
            growing.append((slot, num_tokens))
        self.grow_many(growing)

    def drop_pending_copies(self) -> None:
        """Copy-on-write copies queued for a step that will never run (every request aborted):
        their blocks were just freed, and a later step must not copy into blocks that may belong
        to someone else by then."""
        self.pending_copies.clear()

    def copy_pending_blocks(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Carry out the copies copy-on-write asked for (before the forward pass writes); they are
        returned (sources, destinations) for other ranks' pools (None: none)."""
        if not self.pending_copies:
            return None
        src = np.concatenate([s for s, _ in self.pending_copies])
        dst = np.asarray([b for _, d in self.pending_copies for b in d], dtype=np.int64)
        self.pending_copies.clear()
        self.store.copy_blocks(src, dst)
        return src, dst

    # --- the device mirror ----------------------------------------------------------------
    def _mark_changed(self, slot: int, start: int, stop: int) -> None:
        """Blocks [start, stop) of `slot`, in every layer, are to be copied to the device mirror."""
        if self.tracks_changes and stop > start:
            self._changed.append((slot, start, stop))

    def _changed_indices(self) -> np.ndarray:
        """The flat table indices of the spans marked since the last sync, in a few numpy calls
        however many spans a step marked."""
        _, layers, width = self.table.shape
        slot, start, stop = np.asarray(self._changed, dtype=np.int64).T
        counts = stop - start
        # each span's blocks, one span after another: start, start + 1, ..., stop - 1
        blocks = np.arange(counts.sum()) + np.repeat(start - (np.cumsum(counts) - counts), counts)
        rows = np.repeat(slot, counts) * (layers * width) + blocks
        return (rows[:, None] + np.arange(layers)[None, :] * width).ravel()

    def sync_device_table(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Send the table entries that changed since the last call to the device mirror; they are
        returned (flat index, value) for other ranks' mirrors (None: none changed)."""
        if not self._changed:
            return None
        index = self._changed_indices()
        self._changed.clear()
        values = self.table.ravel()[index]
        if not self.store.mirrors_host:
            self.store.write_table(index, values)
        return index, values
