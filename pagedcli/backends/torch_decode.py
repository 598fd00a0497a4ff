"""Decode attention as torch ops with shapes that depend on the batch size only: what the CUDA
backend runs for a geometry paged_attention.cu cannot serve (cuda_build.py says which), inside
the same CUDA graphs as its kernels.

Every sequence gathers the block table's whole width, so one graph captured per batch size serves
every context length. Keys a sequence does not own (past its context, or unassigned entries) are
zeroed before the product, not only masked: a neighbour's inf or NaN must not reach it even as
0 x inf. A padding row (context 0) attends to one zero key and gets zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention_full_width(q: torch.Tensor, pool: torch.Tensor, layer_table: torch.Tensor,
                                slots: torch.Tensor, context_lens: torch.Tensor, max_context: int) -> torch.Tensor:
    """q: [B, heads, head_dim], one new token per sequence; pool: [blocks, 2, block_size, kv_heads,
    head_dim]; layer_table: [slots, max_blocks] of this layer; context_lens: [B] (the new token
    included). Returns [B, heads, head_dim]."""
    block_size = pool.shape[2]
    key_pos = torch.arange(max_context, device=q.device)
    physical = layer_table[slots.long()][:, key_pos // block_size].long()  # [B, L]
    own = (key_pos[None, :] < context_lens[:, None]) & (physical >= 0)
    block, offset = physical.clamp(min=0), (key_pos % block_size)[None, :]
    keep = own[:, :, None, None]
    k = torch.where(keep, pool[block, 0, offset], 0)  # [B, L, kv_heads, head_dim]
    v = torch.where(keep, pool[block, 1, offset], 0)
    mask = own | ((key_pos[None, :] == 0) & (context_lens[:, None] <= 0))
    out = F.scaled_dot_product_attention(q[:, None].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], enable_gqa=True)  # [B, heads, 1, hd]
    return out[:, :, 0]
