"""The Llama network: one forward pass serves prefill and decode alike.

Tokens come packed ([T]: a whole prompt per sequence at prefill, one token per sequence at decode).
The GEMMs are plain torch (cuBLAS on a GPU) on fused q/k/v and gate/up weights; everything that is
not a GEMM goes through the backend (torch reference or our CUDA kernels), which also puts K/V into
the paged cache and reads them back through the block table. The order of operations and of
roundings is Hugging Face's LlamaForCausalLM, so the two agree token for token.
"""

from __future__ import annotations

import torch

from pagedcli.batch import StepBatch
from pagedcli.config import ModelConfig
from pagedcli.weights import Weights


class Llama:
    def __init__(self, config: ModelConfig, weights: Weights, backend):
        self.config = config
        self.w = weights
        self.backend = backend

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Returns the logits of each sequence's last new token: [B, vocab], float32."""
        c, w, be = self.config, self.w, self.backend
        T = batch.token_ids.shape[0]
        x, residual = w.embed[batch.token_ids], None  # [T, hidden]
        for layer, lw in enumerate(w.layers):
            h, residual = be.add_rms_norm(x, residual, lw.input_norm, c.rms_norm_eps)
            q, k, v = (h @ lw.qkv.T).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
            q = be.rope_write_kv(
                layer, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                v.view(T, c.num_kv_heads, c.head_dim), batch,
            )
            x = be.attend(layer, q, batch).reshape(T, c.q_dim) @ lw.o.T
            h, residual = be.add_rms_norm(x, residual, lw.post_norm, c.rms_norm_eps)
            x = be.silu_mul(h @ lw.gate_up.T) @ lw.down.T
        last = batch.last_index
        h, _ = be.add_rms_norm(x[last], residual[last], w.norm, c.rms_norm_eps)
        return (h @ w.lm_head.T).float()
