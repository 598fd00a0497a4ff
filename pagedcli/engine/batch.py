"""StepBatch: the new tokens of one forward pass, packed, and where they go in the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @classmethod
    def build(cls, is_prefill: bool, slots: list[int], token_ids: list[list[int]], num_cached: list[int],
              device: torch.device, samples: list[bool] | None = None) -> "StepBatch":
        """`token_ids[b]` are sequence b's new tokens, which start at position `num_cached[b]`;
        `samples[b]`: whether it samples this step (default: every one does)."""
        num_new = [len(t) for t in token_ids]
        flat, positions, token_seq, last = [], [], [], []
        for b, (ids, start) in enumerate(zip(token_ids, num_cached)):
            flat.extend(ids)
            positions.extend(range(start, start + len(ids)))
            token_seq.extend([b] * len(ids))
            if samples is None or samples[b]:
                last.append(len(flat) - 1)
        ctx = [c + n for c, n in zip(num_cached, num_new)]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            is_prefill=is_prefill,
            token_ids=tensor(flat, torch.int64),
            positions=tensor(positions, torch.int64),
            token_seq=tensor(token_seq, torch.int64),
            slots=tensor(slots, torch.int32),
            context_lens=tensor(ctx, torch.int32),
            last_index=tensor(last, torch.int64),
            num_new=num_new,
            context_lens_host=ctx,
        )
