"""FP8 (float8 e4m3, vLLM's `fp8`): the one definition of how pagedcli stores K/V and weights in 8 bits.

Both use torch.float8_e4m3fn (1 sign, 4 exponent, 3 mantissa bits; finite up to ±448, no inf) with
float32 scales:

- K/V (`kv_cache_dtype` fp8): stored = e4m3(x / scale), read = float(stored) * scale, one scale per
  layer and KV head (`KVScales`: k and v, [num_layers, num_kv_heads]); 1.0 unless the checkpoint
  ships k_scale / v_scale (vLLM's default and its names).
- weights (`quantization` fp8): the linear layers' [out, in] matrices as e4m3 values with a scale per
  output row (`Fp8Weight`), amax(|row|) / 448 when quantized at load; y = (x . values_row) * scale_row,
  the dot accumulated in float32.

torch's float8 cast does not promise to saturate (out-of-range values may become NaN), so every
cast here clamps to ±FP8_MAX first. Gathers, scatters and copies of fp8 tensors go through their
uint8 view (`raw`): the same bytes, and ops every torch version has for every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype
QUANTIZATIONS = ("none", "fp8")
DEFAULT_KV_SCALE = 1.0  # vLLM's, when the checkpoint has none


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes as uint8 (a view: writes go through); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) as e4m3, saturated at ±448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# --- the KV cache --------------------------------------------------------------------------------
@dataclass
class KVScales:
    """The fp8 pool's scales: float32 [num_layers, num_kv_heads] each, on the pool's device."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def default(cls, num_layers: int, num_kv_heads: int, device) -> "KVScales":
        ones = torch.full((num_layers, num_kv_heads), DEFAULT_KV_SCALE, dtype=torch.float32, device=device)
        return cls(ones, ones.clone())

    def to(self, device) -> "KVScales":
        return KVScales(self.k.to(device), self.v.to(device))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [T, kv_heads, head_dim] in the compute dtype; scale: [kv_heads] (one layer's). The e4m3
    values the pool stores."""
    return to_fp8(x.float() / scale[:, None])


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored: [..., kv_heads, head_dim] e4m3 (or its uint8 bytes); scale: [kv_heads]. The values in `dtype`."""
    if stored.dtype == torch.uint8:
        stored = stored.view(FP8_DTYPE)
    return (stored.float() * scale[:, None]).to(dtype)


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
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    return Fp8Weight(to_fp8(w / scale[:, None]), scale)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(w).T in x's dtype: the float32 dot of x with the e4m3 values, times each row's
    scale (what the fp8 GEMV kernels compute; the reference for them)."""
    y = (x.float() @ w.values.float().T) * w.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
