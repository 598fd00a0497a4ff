"""FP8 weights on more than W8A16_MAX_ROWS rows (prefill, larger decode batches): W8A8 on the fp8
tensor cores, as vLLM runs `--quantization fp8` on Hopper. The rows (or their RMSNorm, fused in)
are quantized per row by fp8_quant.cu, then torch._scaled_mm with per-row and per-channel scales
(the fp8 GEMM torch picks for the GPU: cuBLASLt's on the H200 with CUDA 13, CUTLASS's elsewhere)
multiplies the two e4m3 operands and applies both scales in its epilogue: model/fp8.py's
fp8_linear, whose torch ops serve where this cannot (no fp8 tensor cores before sm_89, widths
not multiples of 16, a torch without the rowwise GEMM for the model dtype).

This pays from a few hundred rows on, where the fp8 GEMMs are well ahead of bf16's; at 64 rows only
gate/up and the LM head's shapes beat bf16, and qkv, o and down are slower, but each is far faster
than the float32 product it replaces (docs/performance-log.md, "FP8")."""

from __future__ import annotations

import numpy as np
import torch

from pagedcli.backends.cuda_launch import aligned, ptr, row_threads
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.model.fp8 import FP8_MMA_MULTIPLE, W8A16_MAX_ROWS, Fp8Weight


def scaled_mm_missing(device_index: int, dtype: torch.dtype) -> str | None:
    """Why torch._scaled_mm cannot take per-row scales with `dtype` out on this GPU (fp8 tensor
    cores given), or None: a 16 x 16 product, once. (Which GEMM serves it depends on the GPU and
    the CUDA version, and some take only bf16 out.)"""
    device = torch.device("cuda", device_index)
    ones = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    scale = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale.t(), out_dtype=dtype)
    except Exception as e:  # whatever this torch raises for a GEMM it lacks (RuntimeError, ValueError, ...)
        first = (str(e).splitlines() or [""])[0][:120]
        return f"this torch has no fp8 GEMM with per-row scales and {str(dtype).removeprefix('torch.')} out ({first})"
    return None


def fp8_gemm(be, x: torch.Tensor, weight: Fp8Weight, norm_weight=None, eps: float = 0.0,
             bias=None) -> torch.Tensor | None:
    """x (or RMSNorm(x) * norm_weight) @ dequant(weight).T (+ bias) in the model dtype, W8A8: None
    where this does not apply (the backend has no fp8 GEMM, W8A16_MAX_ROWS rows or fewer, shapes
    or tensors our kernels do not take); the caller then uses model/fp8.py's torch ops. A bias is
    added to the rounded product (the reference adds it before rounding: one rounding apart)."""
    if not (be.fp8_gemm and isinstance(weight, Fp8Weight)):
        return None
    rows = x.shape[0] if x.dim() == 2 else 0
    N, K = weight.shape
    if not (rows > W8A16_MAX_ROWS and x.shape[1] == K and be.fusable(x) and x.stride(1) == 1
            and K % FP8_MMA_MULTIPLE == 0 and N % FP8_MMA_MULTIPLE == 0
            and weight.values.is_contiguous() and weight.scale.dtype == torch.float32 and weight.scale.is_contiguous()
            and (norm_weight is None or (be.fusable(norm_weight) and norm_weight.is_contiguous()))):
        return None
    values, scales = quantize_rows(be, x, norm_weight, eps)
    out = torch._scaled_mm(values, weight.values.t(), scale_a=scales, scale_b=weight.scale.view(1, N),
                           out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def quantize_rows(be, x: torch.Tensor, norm_weight=None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride), or its RMSNorm times norm_weight, quantized per row by
    fp8_quant.cu: e4m3 values [M, K] and float32 scales [M, 1], model/fp8.py's quantize_rows' bytes."""
    rows, K = x.shape
    values = torch.empty((rows, K), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return values, scales
    vec = be.vec if (K % be.vec == 0 and x.stride(0) % be.vec == 0 and aligned(x, values)
                     and (norm_weight is None or aligned(norm_weight))) else 1
    threads = row_threads(K, vec)  # (rms_norm's: the same sums of squares)
    width = "vec" if vec > 1 else "scalar"
    head, tail = (ptr(x), np.int64(x.stride(0))), (ptr(values), ptr(scales), np.int32(K))
    if norm_weight is None:
        be.launch(f"quantize_rows_{width}", (rows,), (threads,), head + tail)
    else:
        be.launch(f"rms_norm_quantize_rows_{width}", (rows,), (threads,), head + (ptr(norm_weight), np.float32(eps)) + tail)
    return values, scales
