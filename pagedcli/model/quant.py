"""Weights kept compressed: a linear layer's [out, in] matrix as small integers with a scale and an
offset per group of `group` consecutive inputs of a row (W4A16, W8A16: the activations stay in the
model dtype).

    w[o, i] = q[o, i] * scale[o, i // group] + offset[o, i // group]

One form holds what every source ships: GGUF's Q8_0 (signed 8-bit, offset none), Q4_0 (offset
-8 * d), Q4_1 and the K-quants (a minimum per group: offset -min), AWQ's, GPTQ's and
compressed-tensors' zero points (offset -zero * scale), and `quantization` int4 / int8 of a float
checkpoint at load. Scale and offset are float32 (every source's fp16 scales and the products of
the K-quants' super-block scales are exact in it), so dequantizing computes what the source's own
reference computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantWeight:
    """`q`: 4 bits: uint8 [out, in // 2], two values a byte, the even column in the low nibble,
    values 0..15; 8 bits: int8 [out, in] (a 5- or 6-bit source's values fit). `scale`, `offset`:
    float32 [out, in // group]; offset None: 0. `source` names the format for people (Q4_K,
    awq, int4, ...)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    group: int
    source: str

    def __post_init__(self):
        out, groups = self.scale.shape
        width = self.q.shape[1] * (2 if self.bits == 4 else 1)
        assert self.bits in (4, 8) and groups * self.group == width, (self.bits, self.q.shape, self.scale.shape)
        assert self.q.dtype == (torch.uint8 if self.bits == 4 else torch.int8)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.scale.shape[1] * self.group))

    @property
    def nbytes(self) -> int:
        """Bytes read to use the weight: the values, the scales and the offsets."""
        extra = 0 if self.offset is None else self.offset.numel() * self.offset.element_size()
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size() + extra

    def values(self) -> torch.Tensor:
        """q as int16 [out, in] (4 bits unpacked)."""
        if self.bits == 8:
            return self.q.to(torch.int16)
        low, high = (self.q & 0xF).to(torch.int16), (self.q >> 4).to(torch.int16)
        return torch.stack([low, high], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, width = self.shape
        grouped = self.values().float().view(out, -1, self.group) * self.scale[..., None]
        if self.offset is not None:
            grouped = grouped + self.offset[..., None]
        return grouped.reshape(out, width).to(dtype)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 (any integer dtype) -> uint8 [out, in // 2], the even column in the low nibble."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)
