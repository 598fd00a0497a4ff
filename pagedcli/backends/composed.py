"""The fused steps of the backend interface as compositions of their halves, on any backend's
halves (`be.rms_norm`, `be.silu_mul`, `be.rope_write_kv`): what the torch reference runs, and what
the CUDA backend runs, on its own halves, where a fused kernel does not apply. The GEMM between is
torch's (cuBLAS on a GPU)."""

from __future__ import annotations

import torch.nn.functional as F

from pagedcli.backends.cpu_quant import quant_linear
from pagedcli.model.fp8 import Fp8Weight, fp8_linear
from pagedcli.model.quant import QuantWeight


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias, as nn.Linear adds it); an fp8 weight through fp8_linear (its float32
    dot times the row's scale); a QuantWeight on the CPU through cpu_quant.py's forms of it, on a
    GPU dequantized (where the CUDA backend's own kernels do not take it)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    if isinstance(weight, QuantWeight):
        if x.device.type == "cpu":
            return quant_linear(x, weight, bias)
        weight = weight.dequantize(x.dtype)
    return x @ weight.T if bias is None else F.linear(x, weight, bias)


def norm_matmul(be, x, norm_weight, weight, eps, bias=None, normed=None):
    """RMSNorm(x) @ weight.T (+ bias): the pre-norm of attention and of the MLP, with the GEMM after
    it. `normed`: that RMSNorm already, where the residual add before made it (linear_add_norm)."""
    return linear(be.rms_norm(x, norm_weight, eps) if normed is None else normed, weight, bias)


def add_norm(be, residual, product, norm_weight, eps):
    """(residual + product, RMSNorm of the sum by norm_weight): the residual add and the norm the
    sum meets next; no norm (None) without a norm_weight."""
    total = residual + product
    return total, (None if norm_weight is None else be.rms_norm(total, norm_weight, eps))


def attention_inputs(be, layer: int, x, norm_weight, qkv, eps, batch, bias=None, normed=None, qk_norm=None):
    """RMSNorm(x) @ qkv.T (+ bias), then (Qwen3) RMSNorm over each head of q and of k, RoPE on q and
    k, and k, v into the cache: the rotated queries, [T, heads, head_dim]."""
    qkv_out = norm_matmul(be, x, norm_weight, qkv, eps, bias, normed)
    return rope_write_qkv(be, layer, qkv_out, batch, qk_norm, eps)


def rope_write_qkv(be, layer: int, qkv_out, batch, qk_norm=None, eps=None):
    """The qkv projection's output split into q, k and v, then the heads' norms where `qk_norm`
    gives their weights (q's, k's: [head_dim] each), RoPE on q and k, and k, v into the cache: the
    rotated queries, [T, heads, head_dim]."""
    T, c = qkv_out.shape[0], be.config
    q, k, v = qkv_out.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q, k, v = (x.view(T, -1, c.head_dim) for x in (q, k, v))
    if qk_norm is not None:
        q, k = be.rms_norm(q, qk_norm[0], eps), be.rms_norm(k, qk_norm[1], eps)
    return be.rope_write_kv(layer, q, k, v, batch)


def norm_linear_silu(be, x, norm_weight, gate_up, eps, bias=None, normed=None):
    """silu(gate) * up of RMSNorm(x) @ gate_up.T (+ bias): the MLP's first half, with its pre-norm."""
    return be.silu_mul(norm_matmul(be, x, norm_weight, gate_up, eps, bias, normed))


def logits(be, x, norm_weight, lm_head, eps, normed=None):
    """The final norm and the LM head: float32 logits of the dtype's product."""
    return norm_matmul(be, x, norm_weight, lm_head, eps, normed=normed).float()
