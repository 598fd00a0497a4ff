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

from dataclasses import dataclass, field
from typing import Callable

import torch

# `quantization` int4's group (gpt-fast's default); a layer whose inputs it does not divide takes the
# largest of INT4_GROUPS that does, or stays in the model dtype
INT4_GROUP = 128
INT4_GROUPS = (128, 64, 32)


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
    # forms a backend prepares once from these fields and keeps (backends/cpu_quant.py): key -> tensor(s)
    forms: dict = field(default_factory=dict, repr=False, compare=False)

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

    def scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """[in / group, out, 2] scales and zeros in `dtype`, as torch's int4 kernels read a 4-bit
        weight (CPU and CUDA alike): w = (q - 8) * scale + zero, so zero = offset + 8 * scale."""
        zero = 8 * self.scale if self.offset is None else self.offset + 8 * self.scale
        return torch.stack([self.scale.T, zero.T], dim=-1).to(dtype).contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, width = self.shape
        grouped = self.values().float().view(out, -1, self.group) * self.scale[..., None]
        if self.offset is not None:
            grouped = grouped + self.offset[..., None]
        return grouped.reshape(out, width).to(dtype)

    def form(self, key, make: Callable[["QuantWeight"], object]):
        """The prepared form `key` of this weight, made by `make(self)` the first time it is asked for."""
        if key not in self.forms:
            self.forms[key] = make(self)
        return self.forms[key]

    @property
    def symmetric(self) -> bool:
        return self.offset is None

    def describe(self) -> str:
        """The format for people: `Q4_K`, `int4 (group 128, asymmetric)`, `awq (4-bit, group 128)`."""
        return describe([self])


def describe(weights: list[QuantWeight]) -> str:
    """The formats of `weights` for people, one entry a source with its groups: `Q4_K, Q6_K`,
    `int4 (groups 64 and 128, asymmetric)`, `gptq (4-bit, group 128)`."""
    kinds: dict[tuple, list[str]] = {}
    for w in weights:
        group = "per channel" if w.group == w.shape[1] else str(w.group)
        for source in w.source.split("+"):  # a fused weight of parts from several (cat_quant)
            groups = kinds.setdefault((source, w.bits, w.symmetric), [])
            if group not in groups:
                groups.append(group)
    names = []
    for (source, bits, symmetric), groups in kinds.items():
        if source.startswith("Q"):  # GGUF's type names say it all
            names.append(source)
            continue
        numbers = sorted(int(g) for g in groups if g != "per channel")
        parts = [("groups " if len(numbers) > 1 else "group ") + " and ".join(map(str, numbers))] if numbers else []
        detail = ", ".join(parts + (["per channel"] if "per channel" in groups else []))
        if source in ("int4", "int8"):
            names.append(f"{source} ({detail}, {'symmetric' if symmetric else 'asymmetric'})")
        else:
            names.append(f"{source} ({bits}-bit, {detail})")
    return ", ".join(names)


def cat_quant(parts: list[QuantWeight]) -> QuantWeight:
    """QuantWeights of the same inputs, bits and group stacked along their outputs (fused qkv,
    gate_up); a part without offsets takes zeros beside parts with them."""
    first = parts[0]
    assert all(p.bits == first.bits and p.group == first.group and p.shape[1] == first.shape[1] for p in parts)
    offsets = None
    if any(p.offset is not None for p in parts):
        offsets = torch.cat([torch.zeros_like(p.scale) if p.offset is None else p.offset for p in parts])
    sources = dict.fromkeys(p.source for p in parts)
    return QuantWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offsets,
                       first.bits, first.group, "+".join(sources))


def int4_group(width: int) -> int | None:
    """`quantization` int4's group for a layer of `width` inputs: INT4_GROUP, else the largest of
    INT4_GROUPS dividing it; None: none does (the layer stays in the model dtype)."""
    return next((g for g in INT4_GROUPS if width % g == 0), None)


def quantize_int4(w: torch.Tensor, group: int) -> QuantWeight:
    """Round to nearest, asymmetric, a scale and minimum per `group` inputs of a row (gpt-fast's
    int4): scale = (max - min) / 15, q = round((w - min) / scale) in 0..15, offset = min, so
    |w - dequantized| <= scale / 2. A constant group takes scale 1e-6 and q = 0 (exact)."""
    out, width = w.shape
    grouped = w.float().reshape(out, width // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-6)
    q = ((grouped - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(out, width)
    return QuantWeight(pack_int4(q), scale, low, 4, group, "int4")


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Round to nearest, symmetric, a scale per output row (group = the row): scale = amax(|row|) / 127,
    q = round(w / scale) in -127..127; an all-zero row takes scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, 1.0)
    q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return QuantWeight(q, scale, None, 8, w.shape[1], "int8")


def quantize(w: torch.Tensor, quantization: str) -> QuantWeight | None:
    """`quantization` int4 or int8 of a float [out, in] weight; None where int4 has no group for its
    width (the caller keeps it in float)."""
    if quantization == "int8":
        return quantize_int8(w)
    group = int4_group(w.shape[1])
    return None if group is None else quantize_int4(w, group)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 (any integer dtype) -> uint8 [out, in // 2], the even column in the low nibble."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)
