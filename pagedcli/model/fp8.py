"""FP8 weights (`quantization` fp8, vLLM's name), on the e4m3 format of core/fp8.py.

The linear layers' [out, in] matrices as e4m3 values with a scale per output row (`Fp8Weight`),
amax(|row|) / 448 when quantized at load. A product of up to W8A16_MAX_ROWS rows (decode at batches
1 and 2, where reading the weights is all the time there is) keeps the activations in the model
dtype: y = (x . values_row) * scale_row, the dot in float32. More rows (prefill, larger batches)
quantize the activations too, with a scale per row (token) computed from its values as vLLM's
dynamic per-token scheme does (`quantize_rows`): both operands are e4m3 and the product runs on fp8
tensor cores where the GPU has them (W8A8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedcli.core.fp8 import FP8_MAX, to_fp8

# torch._scaled_mm, the W8A8 GEMM past W8A16_MAX_ROWS rows on CUDA, takes K and N in multiples of this
FP8_MMA_MULTIPLE = 16
# Fp8Weight products of at most this many rows read 16-bit activations (gemv.cu's gemv8_ kernels on
# CUDA); more rows quantize them per token (fp8 tensor cores on CUDA: cuda_fp8_gemm.py)
W8A16_MAX_ROWS = 2


# --- weights -------------------------------------------------------------------------------------
@dataclass
class Fp8Weight:
    """A linear layer's weight in fp8: `values` [out, in] float8_e4m3fn, `scale` [out] float32;
    the weight is values * scale[:, None]."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: scale = amax(|row|) / 448, values = e4m3(row / scale). An all-zero row
    takes scale 1 (its values are zeros either way)."""
    w = w.float()
    scale = scale_of(w.abs().amax(dim=1))
    return Fp8Weight(to_fp8(w / scale[:, None]), scale)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of values whose largest magnitude is `amax` (float32): amax / 448, which maps
    it to e4m3's largest value; 1 where amax is 0 (the values are zeros either way). A true division
    on every device: torch on CUDA multiplies by the reciprocal of a Python number instead, which
    differs in the last bit for half the values (and the kernels divide)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), 1.0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] (in the model dtype) per row: e4m3 values [..., K] and float32 scales
    [..., 1], scale = amax(|row|) / 448 (kernels/fp8_quant.cu computes the same bytes; for a row
    holding a NaN, whose product is NaN either way, its scale comes from the row's other values,
    this one's is 1)."""
    scale = scale_of(x.float().abs().amax(dim=-1, keepdim=True))
    return to_fp8(x.float() / scale), scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(w).T in x's dtype (x: [..., K], its rows the product's). Up to W8A16_MAX_ROWS
    rows: the float32 dot of x with the e4m3 values, times each output row's scale (what gemv.cu's
    fp8 kernels compute). More rows: x quantized per row first, the float32 dot of the two e4m3
    operands times both scales (what torch._scaled_mm computes on fp8 tensor cores). The
    reference for both. (So a sequence's greedy text with fp8 weights can depend on how many rows
    its steps share: docs/performance.md, "FP8".)"""
    if math.prod(x.shape[:-1]) <= W8A16_MAX_ROWS:
        y = (x.float() @ w.values.float().T) * w.scale
    else:
        values, scale = quantize_rows(x)
        y = (values.float() @ w.values.float().T) * scale * w.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
