"""gemv.cu at small batches: one GEMM of a decode step (x, or its RMSNorm, times a weight) with
what follows it fused into the same kernel: the residual add, silu(gate) * up, a float32 copy for
the logits, or RoPE and the K/V write of the qkv projection. The weight: the model dtype's, an
Fp8Weight (gemv8_) or a QuantWeight (gemvq4_, gemvq8_: cuda_quant.py)."""

from __future__ import annotations

import numpy as np
import torch

from pagedcli.backends.cuda_build import (
    GEMV_CTAS_PER_SM,
    GEMV_MAX_ROWS,
    GEMV_MAX_SHARED,
    GEMV_QUANT_CTAS_PER_SM,
    GEMV_ROW_BUCKETS,
    GEMV_THREADS,
    VEC_BYTES,
)
from pagedcli.backends.cuda_launch import aligned, ptr
from pagedcli.backends.cuda_quant import gemv_unsupported, group_shift
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.model.fp8 import W8A16_MAX_ROWS, Fp8Weight
from pagedcli.model.quant import QuantWeight


def gemv(be, op: str, x, weight, norm_weight=None, eps=0.0, residual=None,
         rope_kv: tuple | None = None) -> torch.Tensor | None:
    """x (or its RMSNorm) @ weight.T through gemv.cu, followed by what `op` says; None when the
    shapes are not gemv.cu's (too many rows, unaligned, other dtype): the caller uses cuBLAS.
    rope_kv: (layer, batch) for the qkv epilogue, which returns the rotated q. An fp8 weight
    (model/fp8.py) goes to the gemv8_ kernels, with its row scales, at up to W8A16_MAX_ROWS rows
    (more quantize the activations too: cuda_fp8_gemm.py). A QuantWeight goes to gemvq<bits>_
    with its groups, where the backend compiled them (be.quant_bits) and the format is one they
    take (cuda_quant.gemv_unsupported); None otherwise (the caller then uses cuda_quant.quant_gemm)."""
    if isinstance(weight, QuantWeight):
        return gemv_quant(be, op, x, weight, norm_weight, eps, residual, rope_kv)
    fp8 = isinstance(weight, Fp8Weight)
    scales = weight.scale if fp8 else None
    if fp8:
        weight = weight.values
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            return None
    N, K = weight.shape
    rows = x.shape[0] if x.dim() == 2 else 0
    weight_vec = VEC_BYTES // weight.element_size()  # weights to a 16-byte load
    max_rows = min(GEMV_MAX_ROWS, W8A16_MAX_ROWS) if fp8 else GEMV_MAX_ROWS
    if not (rows <= max_rows and (be.fusable(weight) if not fp8 else (
            weight.dtype == FP8_DTYPE and on_device(be, weight) and scales.device == weight.device))
            and weight.is_contiguous() and aligned(weight)):
        return None
    return _launch(be, f"gemv{'8' if fp8 else ''}", op, x, N, K, (ptr(weight),) + ((ptr(scales),) if fp8 else ()),
                   weight_vec, GEMV_CTAS_PER_SM, norm_weight, eps, residual, rope_kv)


def on_device(be, t: torch.Tensor) -> bool:
    """Whether a weight's tensor is on the backend's GPU (the model dtype's: be.fusable)."""
    return t.is_cuda and t.device.index == be.device_index


def gemv_quant(be, op: str, x, weight: QuantWeight, norm_weight=None, eps=0.0, residual=None,
               rope_kv: tuple | None = None) -> torch.Tensor | None:
    """gemv() for a QuantWeight: its values, then its groups (scale, offset or 0, groups a row, the
    group's log2: cuda_quant.group_shift), each float32 [N, groups] and contiguous."""
    N, K = weight.shape
    q, scale, offset = weight.q, weight.scale, weight.offset
    groups = [t for t in (scale, offset) if t is not None]
    if not (weight.bits in be.quant_bits and gemv_unsupported(weight.bits, weight.group, K) is None
            and on_device(be, q) and q.is_contiguous() and aligned(q)
            and all(t.dtype == torch.float32 and t.device == q.device and t.is_contiguous() for t in groups)):
        return None
    head = (ptr(q), ptr(scale), ptr(offset), np.int32(scale.shape[1]), np.int32(group_shift(weight)))
    weight_vec = VEC_BYTES * 8 // weight.bits  # weights to a 16-byte load
    return _launch(be, f"gemvq{weight.bits}", op, x, N, K, head, weight_vec, GEMV_QUANT_CTAS_PER_SM, norm_weight, eps,
                   residual, rope_kv)


def _launch(be, family: str, op: str, x, N: int, K: int, head: tuple, weight_vec: int, ctas_per_sm: int,
            norm_weight, eps, residual, rope_kv) -> torch.Tensor | None:
    """The launch every weight format shares, after its own checks: `head`, the weight's arguments;
    `weight_vec`, its weights to a 16-byte load; None where the rows, input or output are not the
    kernel's (more rows than GEMV_MAX_ROWS are the caller's check)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    paired = op.endswith(("silu_mul", "rope_kv"))  # units of two rows make one output pair
    units = N // 2 if paired else N
    tensors = [t for t in (x, norm_weight, residual) if t is not None]
    if not (1 <= rows <= GEMV_MAX_ROWS and x.shape[1] == K and not (paired and N % 2) and be.fusable(*tensors)
            and K % be.vec == 0 and K % weight_vec == 0 and x.stride(1) == 1
            and x.stride(0) * x.element_size() % VEC_BYTES == 0 and aligned(x)
            and (norm_weight is None or (norm_weight.is_contiguous() and aligned(norm_weight)))):
        return None
    bucket = next(b for b in GEMV_ROW_BUCKETS if b >= rows)
    shared = bucket * K * x.element_size()
    if shared > GEMV_MAX_SHARED:
        return None
    if op.endswith("_add"):
        if residual.shape != (rows, N) or not residual.is_contiguous():
            return None
        out = residual  # updated in place
    elif rope_kv is not None:
        out = torch.empty((rows, be.num_heads, be.head_dim), dtype=be.dtype, device=x.device)
    else:
        out = torch.empty((rows, units), dtype=torch.float32 if op.endswith("float") else x.dtype, device=x.device)
    tail = (ptr(out), np.int64(out.stride(0))) if rope_kv is None else be.rope_kv_args(*rope_kv, out)
    split = be.shapes.gemv_split(units, K, VEC_BYTES / weight_vec, ctas_per_sm)
    ctas = be.shapes.gemv_ctas(units, split, ctas_per_sm)
    be.launch(f"{family}_{bucket}_{op}", (ctas,), (GEMV_THREADS,), head + (
        np.int32(N), np.int32(K), np.int32(rows), np.int32(split), ptr(x), np.int64(x.stride(0)),
        ptr(norm_weight), np.float32(eps),
    ) + tail, shared_mem=shared)
    return out
