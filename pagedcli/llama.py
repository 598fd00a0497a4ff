"""The Llama network, one forward pass for prefill and decode alike.

Tokens come packed ([T]: a prompt each at prefill, one token per sequence at decode) with their
positions; K/V go into the paged cache and attention reads them back through the block table,
both via the attention backend. The rest is plain torch, written as Hugging Face's
LlamaForCausalLM computes it, so the two agree token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedcli.batch import StepBatch
from pagedcli.config import ModelConfig
from pagedcli.rope import RotaryTable, apply_rope
from pagedcli.weights import Weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32, then back to x's dtype before the weight multiplies (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Llama:
    def __init__(self, config: ModelConfig, weights: Weights, attention, max_positions: int):
        self.config = config
        self.w = weights
        self.attention = attention
        device = weights.embed.device
        rope = RotaryTable(config, max_positions, device)
        dtype = weights.embed.dtype
        self.cos, self.sin = rope.cos.to(dtype), rope.sin.to(dtype)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Returns the logits of each sequence's last new token: [B, vocab], float32."""
        c, w = self.config, self.w
        T = batch.token_ids.shape[0]
        x = w.embed[batch.token_ids]  # [T, hidden]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            q, k, v = (h @ lw.qkv.T).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = apply_rope(q.view(T, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(k.view(T, c.num_kv_heads, c.head_dim), cos, sin)
            self.attention.write_kv(layer, k, v.view(T, c.num_kv_heads, c.head_dim), batch)
            attn = self.attention.attend(layer, q, batch)  # [T, heads, head_dim]
            x = x + attn.reshape(T, c.q_dim) @ lw.o.T
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gate, up = (h @ lw.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw.down.T
        x = rms_norm(x[batch.last_index], w.norm, c.rms_norm_eps)
        return (x @ w.lm_head.T).float()
