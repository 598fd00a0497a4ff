"""CUDA graphs for prefill-kind steps: a prompt chunk beside the decoding sequences' tokens.

With chunked prefill most steps under load carry a chunk, and such a step, run eagerly, spends
most of its time on the host launching its kernels and GEMMs one by one (docs/performance-log.md,
"Under arrivals"): far more than its GPU time at small chunks, and every decoding sequence waits
for it. So a prefill-kind step of up to MAX_GRAPH_TOKENS new tokens replays a graph captured for
the next token bucket up, as vLLM does, with the step's inputs padded to the bucket:

- tokens past the step's own sit at position -1 (no K/V written, as the decode graphs' padding)
  and belong to a padding sequence, row `max_slots` of the per-sequence arrays, with no new tokens
  and no context;
- the attention's work is staged here: the first sequences that feed one token (the decoding
  ones), which the decode kernel serves, as a fixed number of rows (their slots and contexts)
  padded with rows of no context, whose zeros land on rows that the prefill kernel then writes
  (CudaBackend._prefill_attend); and the prefill kernel's tiles for the other sequences (their keys
  split as an eager step's would be), padded with tiles of the padding sequence, which find no
  rows and no keys and leave at once;
- the logits are those of the first `min(max_slots, bucket)` sampling rows (the padded ones repeat
  token 0's row and are not returned).

The step's lists go to the graph's static tensors in one host-to-device copy from pinned memory.
One staging buffer is enough: a prefill step is never queued ahead of the host (engine.py), so the
copy of the one before has been waited for before this one is staged. Larger steps run eagerly:
their GPU time covers their host time. The graphs share one memory pool, apart from the decode
graphs' (runner.py).
"""

from __future__ import annotations

import torch

from pagedcli.backends.cuda_launch import PrefillWork, leading_single_rows, max_prefill_tiles, prefill_tile_lists
from pagedcli.backends.graph_capture import CapturedGraphs
from pagedcli.core.batch import StepBatch, pack
from pagedcli.core.kv_store import KVStore

MAX_GRAPH_TOKENS = 2048  # beyond, a step's GPU time exceeds its eager host time (see the docstring)
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


class PrefillGraphs(CapturedGraphs):
    def __init__(self, model, store: KVStore, max_tokens: int):
        self.model, self.store = model, store
        self.rows = model.backend.prefill_rows  # new tokens a tile of the prefill kernel covers
        self.max_seqs = store.max_slots
        self.decode_kernel = model.backend.attention_kernel  # serves the one-token sequences
        self.split_tiles = model.backend.prefill_split_tiles  # the work list's splits (cuda_launch.key_parts)
        self.window = model.backend.config.sliding_window  # (the parts count only the window's key tiles)
        self.pad = self.max_seqs  # the padding sequence's row
        self.buckets = [b for b in BUCKETS if b < min(max_tokens, MAX_GRAPH_TOKENS)]
        self.buckets.append(min(max_tokens, MAX_GRAPH_TOKENS))
        T, B = self.buckets[-1], self.max_seqs + 1
        int64, int32 = torch.int64, torch.int32
        self.layout = (("token_ids", int64, T), ("positions", int64, T), ("token_seq", int64, T),
                       ("last_index", int64, min(self.max_seqs, T)), ("slots", int32, B), ("context_lens", int32, B),
                       *((name, int32, self._tiles(T)) for name in ("tile_seq", "tile_row", "tile_part", "tile_parts")),
                       ("seq_start", int32, B), ("num_new", int32, B),
                       ("decode_slots", int32, self._decode_rows(T)), ("decode_context", int32, self._decode_rows(T)))
        nbytes = sum(_aligned(n * dtype.itemsize) for _, dtype, n in self.layout)
        self.host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
        self.host_np = {name: t.numpy() for name, t in self._views(self.host).items()}
        self.staged = torch.zeros(nbytes, dtype=torch.uint8, device=store.device)
        self.inputs = self._views(self.staged)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, StepBatch, torch.Tensor, torch.Tensor]] = {}

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        views, at = {}, 0
        for name, dtype, n in self.layout:  # every view starts 8-byte aligned
            views[name] = buffer[at:at + n * dtype.itemsize].view(dtype)
            at += _aligned(n * dtype.itemsize)
        return views

    def _tiles(self, n: int) -> int:
        """Entries of bucket n's prefill work list: as many as its tokens can make."""
        return max_prefill_tiles(n, self.max_seqs, self.rows, self.split_tiles)

    def _decode_rows(self, n: int) -> int:
        """Rows bucket n's graph gives the decode kernel: as many as its one-token sequences can be."""
        return min(self.max_seqs, n) if self.decode_kernel else 0

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def _batch(self, n: int) -> StepBatch:
        """Bucket n's static batch: views of the staged inputs."""
        x = self.inputs
        tiles, d = self._tiles(n), self._decode_rows(n)
        return StepBatch(is_prefill=True, token_ids=x["token_ids"][:n], positions=x["positions"][:n],
                         token_seq=x["token_seq"][:n], slots=x["slots"], context_lens=x["context_lens"],
                         last_index=x["last_index"][:min(self.max_seqs, n)], num_new=[], context_lens_host=[],
                         prefill_work=PrefillWork(*(x[name][:tiles] for name in ("tile_seq", "tile_row", "tile_part",
                                                                                 "tile_parts")),
                                                  x["seq_start"], x["num_new"], x["decode_slots"][:d],
                                                  x["decode_context"][:d]))

    def _stage_padding(self) -> None:
        """Every input a padding one: a replay then writes nothing to the pool."""
        h = self.host_np
        h["token_ids"][:], h["positions"][:], h["token_seq"][:], h["last_index"][:] = 0, -1, self.pad, 0
        for name in ("slots", "context_lens", "seq_start", "num_new", "tile_row", "tile_part", "decode_slots",
                     "decode_context"):
            h[name][:] = 0
        h["tile_seq"][:], h["tile_parts"][:] = self.pad, 1
        self.staged.copy_(self.host)

    def padding_batch(self, n: int) -> StepBatch:
        self._stage_padding()
        return self._batch(n)

    def replay(self, slots: list[int], token_ids: list[list[int]], num_cached: list[int],
               samples: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits and greedy tokens, a row per sequence that samples, in order."""
        flat, positions, token_seq, last = pack(token_ids, num_cached, samples)
        T, b, S = len(flat), len(slots), len(last)
        n = next(size for size in self.buckets if size >= T)
        graph, _, logits, greedy = self.graph(n)
        num_new = [len(ids) for ids in token_ids]
        context = [c + k for c, k in zip(num_cached, num_new)]
        d = leading_single_rows(num_new) if self.decode_kernel else 0
        lists = prefill_tile_lists(num_new, context, self.rows, skip=d, split_tiles=self.split_tiles,
                                   window=self.window)
        k, tiles = len(lists.seq), self._tiles(n)
        h = self.host_np
        h["token_ids"][:T], h["positions"][:T], h["token_seq"][:T] = flat, positions, token_seq
        h["token_ids"][T:n], h["positions"][T:n], h["token_seq"][T:n] = 0, -1, self.pad
        h["last_index"][:S], h["last_index"][S:] = last, 0
        for name, values in (("slots", slots), ("context_lens", context), ("seq_start", lists.starts),
                             ("num_new", num_new)):
            h[name][:b], h[name][b:] = values, 0
        for name, values, padding in (("tile_seq", lists.seq, self.pad), ("tile_row", lists.row, 0),
                                      ("tile_part", lists.part, 0), ("tile_parts", lists.parts, 1)):
            h[name][:k], h[name][k:tiles] = values, padding
        h["decode_slots"][:d], h["decode_context"][:d] = slots[:d], context[:d]
        h["decode_slots"][d:], h["decode_context"][d:] = 0, 0  # no keys: zeros, overwritten by the tiles
        self.staged.copy_(self.host, non_blocking=True)
        graph.replay()
        return logits[:S], greedy[:S]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8
