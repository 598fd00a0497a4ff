"""FP8 (float8 e4m3, vLLM's `fp8`): the format, and how the KV pool stores K/V in it
(`kv_cache_dtype` fp8). Weights in fp8 are model/fp8.py's, on this same format.

torch.float8_e4m3fn: 1 sign, 4 exponent, 3 mantissa bits; finite up to ±448, no inf. K/V are stored
as e4m3(x / scale) and read as float(stored) * scale, one float32 scale per layer and KV head
(`KVScales`: k and v, [num_layers, num_kv_heads]); 1.0 unless the checkpoint ships k_scale /
v_scale (vLLM's default and its names).

torch's float8 cast does not promise to saturate (out-of-range values may become NaN), so every
cast here clamps to ±FP8_MAX first. Gathers, scatters and copies of fp8 tensors go through their
uint8 view (`raw`): the same bytes, and ops every torch version has for every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
DEFAULT_KV_SCALE = 1.0  # vLLM's, when the checkpoint has none


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes as uint8 (a view: writes go through); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) as e4m3, saturated at ±448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


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
