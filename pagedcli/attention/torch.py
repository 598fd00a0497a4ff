"""The reference backend: plain torch indexing through the block table, then SDPA.

Per step it gathers each sequence's K/V from its blocks (logical block -> physical block ->
token offset) into a padded batch and runs scaled-dot-product attention with a causal mask.
That gather is a read through the block table, done fresh every layer; nothing is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedcli.batch import StepBatch
from pagedcli.cache import KVCache


class TorchAttention:
    name = "torch"

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.block_size = cache.geometry.block_size
        self._step = None  # per-step indices shared by all layers

    def prepare(self, batch: StepBatch) -> None:
        """Index tensors for this step's gathers and mask; built once, used by every layer."""
        dev = batch.token_ids.device
        B = batch.num_seqs
        Lq, Lk = max(batch.num_new), max(batch.context_lens_host)
        key_pos = torch.arange(Lk, device=dev)
        ctx = batch.context_lens.long()
        num_new = torch.tensor(batch.num_new, device=dev)
        starts = torch.cumsum(num_new, 0) - num_new  # first token of each sequence in T
        row = torch.arange(Lq, device=dev)
        q_pos = (ctx - num_new)[:, None] + row[None, :]  # [B, Lq] positions of the queries
        q_valid = row[None, :] < num_new[:, None]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < ctx[:, None, None])
        mask |= ~q_valid[:, :, None] & (key_pos == 0)  # padding rows see one key: no NaN
        pad_index = (starts[:, None] + row[None, :]).clamp(max=batch.token_ids.numel() - 1)
        token_row = torch.arange(batch.token_ids.numel(), device=dev) - starts[batch.token_seq]
        self._step = dict(
            logical=(key_pos // self.block_size).clamp(max=self.cache.max_blocks_per_seq - 1),
            offset=key_pos % self.block_size,
            slots=batch.slots.long(),
            mask=mask[:, None],  # [B, 1, Lq, Lk]
            pad_index=pad_index,
            token_row=token_row,
        )

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> None:
        slots = batch.slots.long()[batch.token_seq]
        physical = self.cache.device_table[slots, layer, batch.positions // self.block_size].long()
        offset = batch.positions % self.block_size
        self.cache.pool[physical, 0, offset] = k
        self.cache.pool[physical, 1, offset] = v

    def attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        s = self._step
        table = self.cache.device_table[:, layer]
        physical = table[s["slots"][:, None], s["logical"][None, :]].long().clamp(min=0)  # [B, Lk]
        k = self.cache.pool[physical, 0, s["offset"][None, :]]  # [B, Lk, KVH, D]
        v = self.cache.pool[physical, 1, s["offset"][None, :]]
        q_pad = q[s["pad_index"]]  # [B, Lq, H, D]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=s["mask"], enable_gqa=True
        )  # [B, H, Lq, D]
        return out.transpose(1, 2)[batch.token_seq, s["token_row"]]  # [T, H, D]
