"""What one forward pass is: StepPlan, the step as the engine decides it (what rank 0 sends the other
ranks under tensor parallelism); StepBatch, its new tokens packed and where they go in the cache; and
NOT_FINITE, the greedy token of a row whose logits are not finite."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

NOT_FINITE = -1  # argmax's token for a row of logits that holds a NaN or an inf (argmax.cu: -1 too)


@dataclass
class StepPlan:
    """A step as the engine decides it, in plain values: sequence b (in slot `slots[b]`) feeds
    `token_ids[b]` from position `num_cached[b]`; `samples[b]`: whether it samples (None: all do);
    `every_row[b]`: all its new tokens get logits (prompt log-probabilities; None: none). `fed`: a
    decode step's tokens are a device tensor, not `token_ids` (the engine's overlap). `table`: the
    block table's entries (flat index, value) changed since the step before; `copies`: the pool's
    blocks copied (source, destination) before this step writes (copy-on-write)."""

    is_prefill: bool
    slots: list[int]
    token_ids: list[list[int]]
    num_cached: list[int]
    samples: list[bool] | None = None
    every_row: list[bool] | None = None
    fed: bool = False
    table: tuple[np.ndarray, np.ndarray] | None = None
    copies: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def prompt_rows(self) -> bool:
        return self.every_row is not None and any(self.every_row)


@dataclass
class StepBatch:
    """B sequences feed T new tokens in all (prefill: a prompt or a chunk of one each, or one token
    for a decoding sequence in the same step; decode: one token each).

    Token t belongs to sequence `token_seq[t]`, sits at `positions[t]` in that sequence, and its
    K/V go to `table[slots[token_seq[t]], layer, positions[t] // block_size]`. After this step
    sequence b has `context_lens[b]` tokens in the cache. `last_index` holds the last new token of
    each sequence that samples, in order: the rows whose logits are computed (all B, unless a prompt
    chunk stops short of its prompt's end).
    """

    is_prefill: bool
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_seq: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    last_index: torch.Tensor  # [S] int64, S <= B: the sampling rows' last tokens
    num_new: list[int]  # host copies, for shapes
    context_lens_host: list[int]
    # the prefill attention's work list, in the backend's own form, where the backend staged it in
    # tensors of its own (the CUDA backend's captured prefill steps: cuda_launch.PrefillWork); None:
    # the backend plans it from the fields above. Nothing outside the backend reads or sets it.
    prefill_work: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, is_prefill: bool, slots: list[int], token_ids: list[list[int]], num_cached: list[int],
              device: torch.device, samples: list[bool] | None = None,
              every_row: list[bool] | None = None) -> "StepBatch":
        """`token_ids[b]` are sequence b's new tokens, which start at position `num_cached[b]`;
        `samples[b]`: whether it samples this step (default: every one does); `every_row[b]`: all of
        its new tokens get logits, not only its last (prompt log-probabilities)."""
        num_new = [len(t) for t in token_ids]
        flat, positions, token_seq, last = pack(token_ids, num_cached, samples, every_row)
        ctx = [c + n for c, n in zip(num_cached, num_new)]
        int64, int32 = torch.int64, torch.int32
        tensors = to_device({"token_ids": (flat, int64), "positions": (positions, int64), "token_seq": (token_seq, int64),
                             "last_index": (last, int64), "slots": (slots, int32), "context_lens": (ctx, int32)}, device)
        return cls(is_prefill=is_prefill, **tensors, num_new=num_new, context_lens_host=ctx)


def pack(token_ids: list[list[int]], num_cached: list[int], samples: list[bool] | None = None,
         every_row: list[bool] | None = None):
    """The packed arrays of a step (int64): every new token, its position, its sequence, and the
    index of each sampling sequence's last token (StepBatch's fields of the same names), or of all
    its tokens where `every_row` says so. In numpy
    calls, not a Python loop a token: a long prompt's chunk is up to 16,384 tokens, and the GPU idled
    while the host packed them (docs/performance-log.md, "Prefill")."""
    lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
    token_seq = np.repeat(np.arange(len(token_ids), dtype=np.int64), lens)
    first = np.cumsum(lens) - lens  # each sequence's first index in the step
    positions = np.arange(total, dtype=np.int64) + np.repeat(np.asarray(num_cached, dtype=np.int64) - first, lens)
    last = first + lens - 1
    if every_row is not None and any(every_row):  # (rare: a request for prompt log-probabilities)
        keep = samples if samples is not None else [True] * len(lens)
        last = np.concatenate([np.arange(f, f + n) if all_rows else [f + n - 1] if sample else []
                               for f, n, sample, all_rows in zip(first, lens, keep, every_row)]).astype(np.int64)
    elif samples is not None:
        last = last[np.asarray(samples, dtype=bool)]
    return flat, positions, token_seq, last


def to_device(arrays: dict[str, tuple[list[int] | np.ndarray, torch.dtype]],
              device: torch.device) -> dict[str, torch.Tensor]:
    """Lists (or arrays) of ints as tensors of the given dtypes on `device`, in one host-to-device
    copy: packed into one buffer, pinned on a GPU. A copy from pageable memory makes the host wait
    for the GPU's queue before the driver stages it, so each prefill step's index lists (16k entries
    each for a long prompt) left the GPU idle at every copy (docs/performance-log.md, "Prefill"); from
    pinned memory the copy is queued behind the step before, and the host goes on."""
    offsets, total = {}, 0
    for name, (values, dtype) in arrays.items():
        offsets[name] = total
        total += -(-len(values) * dtype.itemsize // 8) * 8  # every view starts 8-byte aligned
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()
    views = {}
    for name, (values, dtype) in arrays.items():
        start, nbytes = offsets[name], len(values) * dtype.itemsize
        raw[start:start + nbytes].view(NUMPY_DTYPES[dtype])[:] = values
        views[name] = (start, nbytes, dtype)
    packed = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return {name: packed[start:start + nbytes].view(dtype) for name, (start, nbytes, dtype) in views.items()}


NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}
