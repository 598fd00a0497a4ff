"""The CPU backend: the torch reference's decode step with few ops (prefill-kind steps run the
reference's attention and K/V writes), and its GEMMs through oneDNN.

The GEMMs are most of a step. torch's float32 GEMM is MKL's, which on this project's AMD CPU reads
a GEMV's weights well below the memory's speed and runs 8-row GEMMs slower still; oneDNN's
(`torch.ops.mkldnn._linear_pointwise`, the kernel inductor's frozen graphs call) on a oneDNN copy
of each float32 weight, made once (`take_weights`), is faster at every batch size measured; for
bfloat16 weights a copy reordered into oneDNN's blocked layout serves decode batches. The copies
double those weights' memory: made only while they take at most a quarter of the machine's.

A decode step on a CPU is mostly Python and dispatch around small tensors: at batch 1 the
reference's gather of every block through the block table, its masks and `where`s cost as much as
the GEMMs (docs/performance.md, "CPU decode"). Here the work that does not depend on the layer is
done once a step, in numpy on the host's block table (on the CPU the store's device table is that
same memory):

- where each new token's K and V go: one pool row per token and layer, so a layer writes K and V
  with one indexed copy each;
- which blocks each sequence reads: its blocks from the one holding its first visible key (0, or a
  sliding window's start) to its last, one `index_select` of whole blocks a layer ([B, K|V, blocks]),
  not a gather of every token of the table's width;
- RoPE's cos and sin rows, with sin's first half negated so that rotate-half is one `roll`.

Attention folds each KV head's group of query heads into the query rows of one SDPA call ([B,
kv_heads, group, head_dim] against [B, kv_heads, keys, head_dim]), so K and V are never repeated
per query head. At batch 1 the keys are sliced to exactly the sequence's own, so there is nothing
to mask; a larger batch pads to its longest sequence, zeroes the keys a sequence does not own (the
reference's rule: a neighbour's inf or NaN must not reach it even as 0 x inf: only those rows of the
gathered copy are written) and masks them.

Greedy tokens check the reference's rule (a row holding a NaN or an inf gets NOT_FINITE) from the
row's least and greatest logit, one pass where isfinite().all() takes five.

The results are the reference's up to the order of float additions (tests/test_cpu_backend.py holds
the two to the same greedy tokens). With an fp8 pool, attention and K/V writes are the reference's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedcli.backends import composed, cpu_kernels
from pagedcli.backends.torch import TorchBackend
from pagedcli.core.batch import NOT_FINITE, StepBatch
from pagedcli.core.kv_store import KVStore
from pagedcli.model.config import ModelConfig
from pagedcli.model.quant import QuantWeight
from pagedcli.model.weights import Weights

# the most rows a bfloat16 GEMM runs on its reordered oneDNN copy: decode batches (1 and 8 measured
# faster), not prompts (128 rows measured slower than torch's bfloat16 GEMM)
ONEDNN_BF16_ROWS = 16


def onednn_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class DecodePlan:
    """One decode step's indices, shared by every layer (DecodePlan.build says what each holds)."""

    cos: torch.Tensor  # [B, 1, head_dim]
    sin: torch.Tensor  # [B, 1, head_dim], first half negated (rotate-half as a roll)
    k_rows: torch.Tensor  # [layers, B]: the pool row (of pool.view(-1, kv_heads, head_dim)) of each K
    v_rows: torch.Tensor  # [layers, B]: and of each V
    blocks: torch.Tensor  # [layers, B * 2 * C]: the K then V halves of each sequence's C blocks
    num_blocks: int  # C
    keys: slice | None  # batch 1: the sequence's own keys among the gathered; None: masked
    unowned: torch.Tensor | None  # the gathered K and V rows ([B * 2 * C * block_size]) of keys not owned
    mask: torch.Tensor | None  # [B, 1, 1, C * block_size] bool: the keys each sequence owns, for SDPA

    @classmethod
    def build(cls, backend: "CpuBackend", batch: StepBatch) -> "DecodePlan":
        bs, window = backend.block_size, backend.config.sliding_window
        table = backend.table  # [slots, layers, max_blocks] int32, the host's (shared) table
        slots = batch.slots.numpy().astype(np.int64)
        ctx = np.asarray(batch.context_lens_host, dtype=np.int64)
        pos = ctx - 1  # each sequence's one new token
        written = table[slots, :, pos // bs].astype(np.int64)  # [B, layers]
        k_rows = written * 2 * bs + (pos % bs)[:, None]  # pool rows: block, K half, offset
        # a query at p sees keys p - window + 1 .. p (transformers' rule); the blocks before the one
        # holding the first may have been given back (engine/cache.py `slide`)
        start = np.maximum(ctx - window, 0) if window else np.zeros_like(ctx)
        first = start // bs
        count = pos // bs - first + 1
        C = int(count.max())
        j = np.arange(C)
        logical = np.minimum(first[:, None] + j, table.shape[2] - 1)  # [B, C]
        physical = table[slots[:, None], :, logical].astype(np.int64)  # [B, C, layers]
        physical = np.where(j[None, :, None] < count[:, None, None], physical, 0).clip(min=0)
        halves = np.stack([2 * physical, 2 * physical + 1], axis=1)  # [B, 2, C, layers]
        blocks = np.ascontiguousarray(halves.transpose(3, 0, 1, 2)).reshape(table.shape[1], -1)
        positions = batch.positions
        cos, sin = backend.rope.rows(positions, batch.context_lens[batch.token_seq])
        half = cos.shape[-1] // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        keys = unowned = mask = None
        if len(ctx) == 1:
            keys = slice(int(start[0] - first[0] * bs), int(ctx[0] - first[0] * bs))
        else:
            key_pos = first[:, None] * bs + np.arange(C * bs)  # [B, C * bs]
            own = (key_pos >= start[:, None]) & (key_pos < ctx[:, None])
            b, key = np.nonzero(~own)  # the tails of last blocks, and the shorter sequences' padding
            unowned = torch.from_numpy(np.concatenate([(2 * b) * C * bs + key, (2 * b + 1) * C * bs + key]))
            mask = torch.from_numpy(own)[:, None, None, :]
        return cls(cos[:, None], sin[:, None], torch.from_numpy(np.ascontiguousarray(k_rows.T)),
                   torch.from_numpy(np.ascontiguousarray((k_rows + bs).T)), torch.from_numpy(blocks), C, keys,
                   unowned, mask)


class CpuBackend(TorchBackend):
    """TorchBackend with a decode step of few ops and oneDNN's GEMMs (the module's docstring); the
    rest (prefill-kind steps' attention and K/V writes, and every step's with an fp8 pool) is the
    reference's."""

    def __init__(self, store: KVStore, config: ModelConfig):
        super().__init__(store, config)
        g = store.geometry
        self.table = store.device_table.numpy()  # the host's table itself (KVStore: mirrors_host)
        self.fast = store.mirrors_host and store.kv_scales is None
        pool = store.pool
        self.kv_rows = pool.view(-1, g.num_kv_heads, config.head_dim)  # [blocks * 2 * block_size, kv_heads, hd]
        self.kv_blocks = pool.view(g.num_blocks * 2, -1)  # [blocks * 2, block_size * kv_heads * hd]
        self.plan: DecodePlan | None = None
        self.onednn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its oneDNN copy)

    def take_weights(self, weights: Weights) -> None:
        """oneDNN copies of the float32 and bfloat16 linear weights, which `linear` then multiplies
        by (the module's docstring says why; docs/performance.md, "CPU decode", by how much). They
        double those weights' memory, so only while the weights take at most a quarter of the
        machine's. Compressed weights keep their own paths (composed.linear), but for a QuantWeight with
        float32 activations, which multiplies by its dequantized matrix: `linear` makes its oneDNN copy."""
        linears = [w for lw in weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [weights.lm_head]
        linears = [w for w in linears if isinstance(w, torch.Tensor) and w.dtype in (torch.float32, torch.bfloat16)]
        if not linears or not onednn_available():
            return
        if 4 * sum(w.numel() * w.element_size() for w in linears) > physical_memory():
            return
        # float32 in oneDNN's plain layout; bfloat16 reordered into its blocked layout for few rows
        # (the plain one is no faster than torch's bfloat16 GEMM, which is oneDNN's already)
        self.onednn = {id(w): (w, w.to_mkldnn() if w.dtype == torch.float32
                               else torch.ops.mkldnn._reorder_linear_weight(w, 1)) for w in linears}

    def linear(self, x, weight, bias=None):
        """x @ weight.T (+ bias): a decode step's few float32 rows through our kernels (cpu_kernels.py:
        a float32 weight, or a QuantWeight at one row), else through the weight's oneDNN copy where
        take_weights made one (a bfloat16 one for up to ONEDNN_BF16_ROWS rows: prompts run faster on
        torch's own)."""
        if x.dtype == torch.float32 and x.shape[0] <= cpu_kernels.MAX_ROWS:
            out = cpu_kernels.gemv(x, weight, bias)
            if out is not None:
                return out
        if isinstance(weight, QuantWeight) and x.dtype == torch.float32 and onednn_available():
            # float32 activations multiply by the dequantized matrix (backends/cpu_quant.py says why):
            # its oneDNN copy, made once, in place of the plain one
            copy = weight.form(("onednn", torch.float32), lambda w: w.dequantize(torch.float32).to_mkldnn())
            return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")
        packed = self.onednn.get(id(weight))  # (the weight is held beside it: its id stays its own)
        if packed is None or (weight.dtype == torch.bfloat16 and x.shape[0] > ONEDNN_BF16_ROWS):
            return composed.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed[1], bias, "none", [], "")

    # the fused steps as the reference composes them (composed.py), with this backend's linear
    def norm_linear(self, x, norm_weight, weight, eps, bias=None, normed=None):
        return self.linear(self.rms_norm(x, norm_weight, eps) if normed is None else normed, weight, bias)

    def linear_add(self, x, weight, residual, bias=None):
        return residual + self.linear(x, weight, bias)

    def linear_add_norm(self, x, weight, residual, norm_weight, eps, bias=None):
        return composed.add_norm(self, residual, self.linear(x, weight, bias), norm_weight, eps)

    def norm_linear_silu(self, x, norm_weight, gate_up, eps, bias=None, normed=None):
        return self.silu_mul(self.norm_linear(x, norm_weight, gate_up, eps, bias, normed))

    def logits(self, x, norm_weight, lm_head, eps, normed=None):
        return self.norm_linear(x, norm_weight, lm_head, eps, normed=normed).float()

    def prepare(self, batch: StepBatch) -> None:
        if self.fast and not batch.is_prefill:
            self.plan, self._step = DecodePlan.build(self, batch), {}
        else:
            self.plan = None
            super().prepare(batch)

    def argmax(self, logits):
        """The reference's rule (NOT_FINITE for a row holding a NaN or an inf) from each row's least
        and greatest logit, which a NaN or an inf makes non-finite (aminmax propagates NaN)."""
        low, high = torch.aminmax(logits, dim=-1)
        return torch.where(low.isfinite() & high.isfinite(), logits.argmax(dim=-1), NOT_FINITE)

    def rms_norm(self, x, weight, eps):
        if x.dtype != torch.float32:  # the reference's roundings, in its order
            return super().rms_norm(x, weight, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)))

    def attention_inputs(self, layer: int, x, norm_weight, qkv, eps, batch: StepBatch, bias=None, normed=None,
                         qk_norm=None):
        p = self.plan
        out = self.norm_linear(x, norm_weight, qkv, eps, bias, normed)
        if p is None:
            return composed.rope_write_qkv(self, layer, out, batch, qk_norm, eps)
        c = self.config
        B, H = out.shape[0], c.num_heads
        qk = out[:, :c.q_dim + c.kv_dim].view(B, -1, c.head_dim)  # [B, heads + kv_heads, hd]
        if qk_norm is not None:  # Qwen3: RMSNorm over each head of q and of k, before RoPE
            qk = torch.cat([self.rms_norm(qk[:, :H], qk_norm[0], eps), self.rms_norm(qk[:, H:], qk_norm[1], eps)], 1)
        # rotate-half RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) * sin = roll(x) * sin'
        rotated = qk * p.cos + qk.roll(c.head_dim // 2, -1) * p.sin
        self.kv_rows[p.k_rows[layer]] = rotated[:, H:]
        self.kv_rows[p.v_rows[layer]] = out[:, c.q_dim + c.kv_dim:].view(B, -1, c.head_dim)
        return rotated[:, :H]

    def attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        p = self.plan
        if p is None:
            return super().attend(layer, q, batch)
        B, H, hd = q.shape
        kv_heads = self.config.num_kv_heads
        kv = self.kv_blocks.index_select(0, p.blocks[layer])  # a copy: its rows may be zeroed
        if p.keys is not None:
            kv = kv.view(B, 2, -1, kv_heads, hd)[:, :, p.keys]
        else:  # keys a sequence does not own become exact zeros: masked out, and 0 x 0 is 0
            kv = kv.view(-1, kv_heads, hd).index_fill_(0, p.unowned, 0).view(B, 2, -1, kv_heads, hd)
        kv = kv.transpose(2, 3)  # [B, 2, kv_heads, keys, hd]
        q = q.view(B, kv_heads, H // kv_heads, hd)  # a KV head's group of query heads as its query rows
        out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=p.mask)
        return out.reshape(B, H, hd)
