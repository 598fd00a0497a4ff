"""Prefix caching: full blocks found again by their content.

A full block is named by a chained hash, hash(previous block's hash, this block's token ids), as
vLLM names it: equal hashes mean equal token prefixes, so equal K/V in every layer. The cache maps
each hash to the physical blocks (one per layer) that hold that block. A new prompt whose first
blocks hash to known entries shares those blocks (reference counts) and computes only the rest.
Entries outlive their sequences: a block whose count falls to 0 stays findable in the free list
until the allocator hands it out again, least recently freed first.
"""

from __future__ import annotations


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Grow `hashes`, the chained hashes of the first full blocks of `token_ids`, to `num_blocks`
    entries. A sequence keeps its list for its whole life (tokens are only ever appended, so the
    hashes stay true), and each block is hashed once."""
    h = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(h)


class PrefixCache:
    def __init__(self):
        self.rows: dict[int, tuple[int, ...]] = {}  # hash -> physical block of each layer
        self.hash_of: dict[int, int] = {}  # physical block -> the hash whose row holds it

    def lookup(self, hashes: list[int], limit: int) -> list[tuple[int, ...]]:
        """The rows of the longest run of known hashes from the start, at most `limit`."""
        rows = []
        for h in hashes[:limit]:
            row = self.rows.get(h)
            if row is None:
                break
            rows.append(row)
        return rows

    def insert(self, h: int, row: tuple[int, ...]) -> None:
        if h in self.rows or any(b in self.hash_of for b in row):
            return  # first writer wins; a duplicate computed meanwhile stays private
        self.rows[h] = row
        for b in row:
            self.hash_of[b] = h

    def forget(self, blocks: list[int]) -> None:
        """These blocks are being reused for other tokens: a row that holds one is no longer a
        cached prefix. (One call for all the blocks a step takes: a call per block cost the host
        more than the rest of taking them.)"""
        hash_of = self.hash_of
        if not hash_of:
            return
        for block in blocks:
            h = hash_of.pop(block, None)
            if h is not None:
                for b in self.rows.pop(h):
                    hash_of.pop(b, None)
