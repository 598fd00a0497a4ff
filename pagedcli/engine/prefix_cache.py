"""Prefix caching: full blocks found again by their content.

A full block is named by a chained hash, hash(previous block's hash, this block's token ids), as
vLLM names it: equal hashes mean equal token prefixes, so equal K/V in every layer. The cache maps
each hash to the physical blocks (one per layer) that hold that block. A new prompt whose first
blocks hash to known entries shares those blocks (reference counts) and computes only the rest.
Entries outlive their sequences: a block whose count falls to 0 stays findable in the free list
until the allocator hands it out again, least recently freed first.
"""

from __future__ import annotations

import numpy as np


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Grow `hashes`, the chained hashes of the first full blocks of `token_ids`, to `num_blocks`
    entries. A sequence keeps its list for its whole life (tokens are only ever appended, so the
    hashes stay true), and each block is hashed once."""
    h = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(h)


class PrefixCache:
    """The cached full blocks: hash -> row (a physical block per layer), and for each physical
    block the hash whose row holds it, as arrays over the pool, so that forgetting the blocks a
    step takes is a few numpy operations whatever their number (a whole prompt's: BlockAllocator
    says why that matters)."""

    def __init__(self, num_blocks: int):
        self.rows: dict[int, np.ndarray] = {}  # hash -> physical block of each layer
        self.held = np.zeros(num_blocks, dtype=bool)  # the block is in a row of `rows`
        self.hash_of = np.zeros(num_blocks, dtype=np.int64)  # (where held) that row's hash

    def lookup(self, hashes: list[int], limit: int) -> list[np.ndarray]:
        """The rows of the longest run of known hashes from the start, at most `limit`."""
        rows = []
        for h in hashes[:limit]:
            row = self.rows.get(h)
            if row is None:
                break
            rows.append(row)
        return rows

    def insert(self, hashes: list[int], rows: np.ndarray) -> None:
        """Offer rows[i] (a block per layer) as the cached block hashes[i]. The first writer wins: a
        hash known already, or a row with a block that another row holds (or that an earlier row of
        this call has), stays private."""
        flat = rows.ravel()
        repeated = np.ones(flat.shape, dtype=bool)  # the block came in an earlier place of this call
        repeated[np.unique(flat, return_index=True)[1]] = False
        taken = (self.held[rows] | repeated.reshape(rows.shape)).any(axis=1).tolist()
        kept = []
        for i, (h, t) in enumerate(zip(hashes, taken)):
            if not t and h not in self.rows:
                self.rows[h] = rows[i]
                kept.append(i)
        if kept:
            self.held[rows[kept]] = True
            self.hash_of[rows[kept]] = np.asarray(hashes, dtype=np.int64)[kept, None]

    def forget(self, blocks: np.ndarray) -> None:
        """These blocks are being reused for other tokens: a row that holds one is no longer a
        cached prefix. (One call for all the blocks a step takes: a call per block cost the host
        more than the rest of taking them.)"""
        hit = blocks[self.held[blocks]]
        for h in set(self.hash_of[hit].tolist()):
            self.held[self.rows.pop(h)] = False
