"""gemv.cu at small batches: one GEMM of a decode step (x, or its RMSNorm, times a weight) with
what follows it fused into the same kernel: the residual add, silu(gate) * up, a float32 copy for
the logits, or RoPE and the K/V write of the qkv projection."""

from __future__ import annotations

import numpy as np
import torch

from pagedcli.backends.cuda_build import GEMV_MAX_ROWS, GEMV_MAX_SHARED, GEMV_ROW_BUCKETS, GEMV_THREADS, VEC_BYTES
from pagedcli.backends.cuda_launch import aligned, ptr
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.model.fp8 import W8A16_MAX_ROWS, Fp8Weight


def gemv(be, op: str, x, weight, norm_weight=None, eps=0.0, residual=None,
         rope_kv: tuple | None = None) -> torch.Tensor | None:
    """x (or its RMSNorm) @ weight.T through gemv.cu, followed by what `op` says; None when the
    shapes are not gemv.cu's (too many rows, unaligned, other dtype): the caller uses cuBLAS.
    rope_kv: (layer, batch) for the qkv epilogue, which returns the rotated q. An fp8 weight
    (model/fp8.py) goes to the gemv8_ kernels, with its row scales, at up to W8A16_MAX_ROWS rows
    (more quantize the activations too: cuda_fp8_gemm.py)."""
    fp8 = isinstance(weight, Fp8Weight)
    scales = weight.scale if fp8 else None
    if fp8:
        weight = weight.values
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            return None
    N, K = weight.shape
    rows = x.shape[0] if x.dim() == 2 else 0
    paired = op.endswith(("silu_mul", "rope_kv"))  # units of two rows make one output pair
    units = N // 2 if paired else N
    tensors = [t for t in (x, norm_weight, residual) if t is not None] + ([] if fp8 else [weight])
    weight_vec = VEC_BYTES // weight.element_size()  # weights to a 16-byte load
    max_rows = min(GEMV_MAX_ROWS, W8A16_MAX_ROWS) if fp8 else GEMV_MAX_ROWS
    if not (1 <= rows <= max_rows and x.shape[1] == K and not (paired and N % 2)
            and be.fusable(*tensors)
            and (not fp8 or (weight.dtype == FP8_DTYPE and weight.is_cuda and weight.device.index == be.device_index
                             and scales.device == weight.device))
            and K % be.vec == 0 and K % weight_vec == 0 and weight.is_contiguous() and x.stride(1) == 1
            and x.stride(0) * x.element_size() % VEC_BYTES == 0 and aligned(x, weight)
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
    kernel = f"gemv{'8' if fp8 else ''}_{bucket}_{op}"
    split = be.shapes.gemv_split(units, K, weight.element_size())
    ctas = be.shapes.gemv_ctas(units, split)
    be.launch(kernel, (ctas,), (GEMV_THREADS,), (ptr(weight),) + ((ptr(scales),) if fp8 else ()) + (
        np.int32(N), np.int32(K), np.int32(rows), np.int32(split), ptr(x), np.int64(x.stride(0)),
        ptr(norm_weight), np.float32(eps),
    ) + tail, shared_mem=shared)
    return out
