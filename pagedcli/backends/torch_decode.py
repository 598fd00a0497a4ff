"""Decode attention as torch ops with shapes that depend on the batch size only: what the CUDA
backend runs for a geometry paged_attention.cu cannot serve (cuda_build.py says which), inside
the same CUDA graphs as its kernels.

Every sequence gathers the block table's whole width, so one graph captured per batch size serves
every context length. Keys a sequence does not own (past its context, or unassigned entries) are
zeroed before the product, not only masked: a neighbour's inf or NaN must not reach it even as
0 x inf. A padding row (context 0) attends to one zero key and gets zeros. An fp8 pool is dequantized with
the layer's scales (model/fp8.py) as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedcli.core.fp8 import dequantize_kv, raw


def decode_attention_full_width(q: torch.Tensor, pool: torch.Tensor, layer_table: torch.Tensor,
                                slots: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                window: int | None = None) -> torch.Tensor:
    """q: [B, heads, head_dim], one new token per sequence; pool: [blocks, 2, block_size, kv_heads,
    head_dim]; layer_table: [slots, max_blocks] of this layer; context_lens: [B] (the new token
    included); k_scale, v_scale: the layer's [kv_heads] scales of an fp8 pool; window: a sliding
    window's length (the new token sees itself and the window - 1 keys before it). Returns [B, heads,
    head_dim]."""
    block_size = pool.shape[2]
    key_pos = torch.arange(max_context, device=q.device)
    physical = layer_table[slots.long()][:, key_pos // block_size].long()  # [B, L]
    own = (key_pos[None, :] < context_lens[:, None]) & (physical >= 0)
    if window:
        own &= key_pos[None, :] >= context_lens[:, None] - window
    block, offset = physical.clamp(min=0), (key_pos % block_size)[None, :]
    keep = own[:, :, None, None]
    pool = raw(pool)
    k, v = pool[block, 0, offset], pool[block, 1, offset]  # [B, L, kv_heads, head_dim]
    if k_scale is not None:
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
    k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)
    mask = own | ((key_pos[None, :] == 0) & (context_lens[:, None] <= 0))
    out = F.scaled_dot_product_attention(q[:, None].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], enable_gqa=True)  # [B, heads, 1, hd]
    return out[:, :, 0]
