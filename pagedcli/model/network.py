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

Under tensor parallelism (`tp`: core/parallel.py) each rank runs this pass on its share of the heads
and columns (model/sharding.py): the o and down projections give partial products that one
all-reduce each sums (their biases added after it, once), the embedding's lookups come from the rank
holding each token's row (an all-reduce of the rows, zero elsewhere), and the LM head's shares of the
vocabulary are gathered into whole rows of logits on every rank.
"""

from __future__ import annotations

import torch

from pagedcli.core.batch import StepBatch
from pagedcli.core.parallel import TensorParallelGroup, vocab_share
from pagedcli.model.config import ModelConfig
from pagedcli.model.weights import Weights


class Llama:
    def __init__(self, config: ModelConfig, weights: Weights, backend, tp: TensorParallelGroup | None = None):
        """`config`: the network this rank runs (model/sharding.py rank_config: its heads and
        columns); `tp`: the ranks it shares the model with, None alone."""
        self.config = config
        self.w = weights
        self.backend = backend
        self.tp = tp if tp is not None and tp.world > 1 else None

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the last new token of each sequence that samples (`batch.last_index`),
        [S, vocab] float32, and their greedy tokens, [S] int64 (the backend's argmax: a kernel of
        ours on a GPU, inside the decode graph)."""
        c, w, be = self.config, self.w, self.backend
        be.prepare(batch)  # the index tensors every layer shares
        T, eps = batch.token_ids.shape[0], c.rms_norm_eps
        residual = self.embed(batch.token_ids)  # [T, hidden]: the residual stream, one row per token
        # RMSNorm(residual) by the norm that reads it next, where the backend made it together with
        # the residual add (past gemv.cu's rows: one kernel instead of two); None: the next step norms
        normed = None
        for layer, lw in enumerate(w.layers):
            next_norm = w.layers[layer + 1].input_norm if layer + 1 < len(w.layers) else w.norm
            q = be.attention_inputs(layer, residual, lw.input_norm, lw.qkv, eps, batch, bias=lw.qkv_bias,
                                    normed=normed, qk_norm=lw.qk_norm)
            attn = be.attend(layer, q, batch).reshape(T, c.q_dim)
            residual, normed = self.project_add_norm(attn, lw.o, lw.o_bias, residual, lw.post_norm)
            act = be.norm_linear_silu(residual, lw.post_norm, lw.gate_up, eps, bias=lw.gate_up_bias,
                                      normed=normed)
            residual, normed = self.project_add_norm(act, lw.down, lw.down_bias, residual, next_norm)
        if batch.is_prefill:  # decode has one token per sequence: every row is a last one, and samples
            residual = residual[batch.last_index]
            normed = None if normed is None else normed[batch.last_index]
        if self.tp is None:
            return be.logits_greedy(residual, w.norm, w.lm_head, eps, normed=normed)
        share = be.logits(residual, w.norm, w.lm_head, eps, normed=normed)  # [S, this rank's share] float32
        width = vocab_share(c.vocab_size, self.tp.world, self.tp.rank)[2]
        if share.shape[1] < width:  # the last share of a vocabulary the ranks do not divide
            share = torch.nn.functional.pad(share, (0, width - share.shape[1]))
        logits = self.tp.gather_columns(share, c.vocab_size)
        return logits, be.argmax(logits)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `token_ids`; under tensor parallelism each rank holds a share of the
        vocabulary's rows, gives zeros for the others, and the all-reduce sums the rows (each
        token's one row and zeros: exactly its row)."""
        if self.tp is None:
            return self.w.embed[token_ids]
        first, stop, _ = vocab_share(self.config.vocab_size, self.tp.world, self.tp.rank)
        mine = (token_ids >= first) & (token_ids < stop)
        rows = self.w.embed[torch.where(mine, token_ids - first, 0)]
        return self.tp.all_reduce(torch.where(mine[:, None], rows, 0))

    def project_add_norm(self, x, weight, bias, residual, norm_weight):
        """residual + x @ weight.T (+ bias) and its RMSNorm by norm_weight (the backend's
        linear_add_norm); under tensor parallelism the product is this rank's partial one, summed
        over the ranks before the add."""
        be, eps = self.backend, self.config.rms_norm_eps
        if self.tp is None:
            return be.linear_add_norm(x, weight, residual, norm_weight, eps, bias=bias)
        product = self.tp.all_reduce(be.linear(x, weight))
        return be.add_norm(residual, product if bias is None else product + bias, norm_weight, eps)
