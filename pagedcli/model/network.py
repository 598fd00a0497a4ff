"""The Llama network (and the families that differ from it by a little: model/families/): one forward
pass serves prefill and decode alike.

Tokens come packed ([T]: a whole prompt per sequence at prefill, one token per sequence at decode).
Each GEMM goes through the backend together with the step before or after it (the torch reference
does them one by one; the CUDA backend fuses them into one kernel at small batches and uses cuBLAS
at large ones, with the residual add and the norm after it in one kernel), on fused q/k/v and
gate/up weights (and their biases, where the family or config.json has them; Qwen3's norms over each
head of q and k). The backend also puts K/V into the paged cache and reads them back through the
block table (a sliding window's keys only, for Mistral's). The order of operations and of roundings
is Hugging Face's LlamaForCausalLM (Qwen2ForCausalLM, ...), so the two agree token for token.
"""

from __future__ import annotations

import torch

from pagedcli.core.batch import StepBatch
from pagedcli.model.config import ModelConfig
from pagedcli.model.weights import Weights


class Llama:
    def __init__(self, config: ModelConfig, weights: Weights, backend):
        self.config = config
        self.w = weights
        self.backend = backend

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the last new token of each sequence that samples (`batch.last_index`),
        [S, vocab] float32, and their greedy tokens, [S] int64 (the backend's argmax: a kernel of
        ours on a GPU, inside the decode graph)."""
        c, w, be = self.config, self.w, self.backend
        be.prepare(batch)  # the index tensors every layer shares
        T, eps = batch.token_ids.shape[0], c.rms_norm_eps
        residual = w.embed[batch.token_ids]  # [T, hidden]: the residual stream, one row per token
        # RMSNorm(residual) by the norm that reads it next, where the backend made it together with
        # the residual add (past gemv.cu's rows: one kernel instead of two); None: the next step norms
        normed = None
        for layer, lw in enumerate(w.layers):
            next_norm = w.layers[layer + 1].input_norm if layer + 1 < len(w.layers) else w.norm
            q = be.attention_inputs(layer, residual, lw.input_norm, lw.qkv, eps, batch, bias=lw.qkv_bias,
                                    normed=normed, qk_norm=lw.qk_norm)
            attn = be.attend(layer, q, batch).reshape(T, c.q_dim)
            residual, normed = be.linear_add_norm(attn, lw.o, residual, lw.post_norm, eps, bias=lw.o_bias)
            act = be.norm_linear_silu(residual, lw.post_norm, lw.gate_up, eps, bias=lw.gate_up_bias,
                                      normed=normed)
            residual, normed = be.linear_add_norm(act, lw.down, residual, next_norm, eps, bias=lw.down_bias)
        if batch.is_prefill:  # decode has one token per sequence: every row is a last one, and samples
            residual = residual[batch.last_index]
            normed = None if normed is None else normed[batch.last_index]
        return be.logits_greedy(residual, w.norm, w.lm_head, eps, normed=normed)
