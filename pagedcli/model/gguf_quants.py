"""GGUF's quant blocks decoded (vectorised, numpy) into QuantWeight's one form: values, a float32
scale and offset per group (model/quant.py), so that q * scale + offset is, in float32, what ggml's
reference dequantizer computes (the tests hold each type to `gguf.quants.dequantize`).

The layouts, from ggml-common.h (d, dmin: float16; a row of a tensor is a run of blocks):
  Q8_0  34 B / 32 values: d, int8 q[32]                          w = d * q
  Q4_0  18 B / 32: d, q[16] (value j in byte j's low nibble, j+16 in its high one)  w = d * (q - 8)
  Q4_1  20 B / 32: d, m, q[16] as Q4_0                            w = d * q + m
  Q5_0  22 B / 32: d, qh (32 bits: bit j the fifth bit of value j), q[16] as Q4_0   w = d * (q - 16)
  Q5_1  24 B / 32: d, m, qh, q[16] as Q5_0                        w = d * q + m
        (K-quant files hold them where a row is no whole number of 256-value super-blocks)
  Q4_K 144 B / 256: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, q[128]
        (each 64 values: 32 bytes, low nibbles the first 32, high nibbles the next)
                                                                  w = d * sc * q - dmin * m
  Q5_K 176 B / 256: as Q4_K with qh[32] before q[128]: bit 2c / 2c + 1 of qh[l] is the fifth bit of
        value l of sub-block 2c / 2c + 1
  Q6_K 210 B / 256: ql[128], qh[64], int8 scales[16], d (last): 16 groups of 16, q 6 bits - 32
                                                                  w = d * scale * q
"""

from __future__ import annotations

import numpy as np
import torch

from pagedcli.model.quant import QuantWeight

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")
SUPPORTED = FLOATS + QUANTIZED
BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def floats(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32, F16 or BF16 tensor's bytes as a tensor of its own dtype (a copy, off the mapped file)."""
    if kind == "BF16":
        return torch.from_numpy(raw.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
    dtype = np.float32 if kind == "F32" else np.float16
    return torch.from_numpy(raw.view(dtype).reshape(shape).copy())


def _f16(column: np.ndarray) -> np.ndarray:
    """Two bytes a block (any columns of the block array) as float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes a super-block as 8 six-bit scales and 8 six-bit mins (ggml's
    get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 a nibble
    of bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7 above it."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(q: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, k * run] holding 2 * run values per run of `run` bytes (low nibbles first, then
    high) -> values [n, 2 * k * run] in order."""
    n = q.shape[0]
    q = q.reshape(n, -1, 1, run)
    return np.concatenate([q & 15, q >> 4], axis=2).reshape(n, -1)


def decode(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantWeight:
    """The blocks of an [out, in] tensor of a QUANTIZED type as a QuantWeight."""
    out, width = shape
    values, block_bytes = BLOCK[kind]
    blocks = raw.reshape(out * width // values, block_bytes)
    n = blocks.shape[0]
    offset = None
    if kind == "Q8_0":
        scale, q = _f16(blocks[:, :2]), blocks[:, 2:].view(np.int8)
        bits, group = 8, 32
    elif kind in ("Q4_0", "Q4_1"):
        d = _f16(blocks[:, :2])
        data = blocks[:, 2:] if kind == "Q4_0" else blocks[:, 4:]
        q, scale, bits, group = _nibbles(data, 16), d, 4, 32
        offset = -8 * d if kind == "Q4_0" else _f16(blocks[:, 2:4])  # -8 d: exact in float32
    elif kind in ("Q5_0", "Q5_1"):
        d, start = _f16(blocks[:, :2]), 2 if kind == "Q5_0" else 4
        qh = blocks[:, start:start + 4]  # little-endian: bit j of byte b, the fifth bit of value 8 b + j
        high = ((qh[:, :, None] >> np.arange(8, dtype=np.uint8)[None, None, :]) & 1).reshape(n, 32)
        q, scale, bits, group = (_nibbles(blocks[:, start + 4:], 16) | (high << 4)).astype(np.int8), d, 8, 32
        offset = -16 * d if kind == "Q5_0" else _f16(blocks[:, 2:4])  # -16 d: exact in float32
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        scale, offset = d * sc, -(dmin * mn)  # the products ggml's reference forms, in float32
        if kind == "Q4_K":
            q, bits = _nibbles(blocks[:, 16:], 32), 4
        else:
            qh = blocks[:, 16:48]  # bit j of qh[l]: the fifth bit of value l of sub-block j
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q, bits = (_nibbles(blocks[:, 48:], 32) | (high.reshape(n, -1) << 4)).astype(np.int8), 8
        group = 32
    elif kind == "Q6_K":
        ql, qh, d = blocks[:, :128], blocks[:, 128:192], _f16(blocks[:, 208:210])
        scale = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
        # each half of 128 values: ql[64] (low nibbles: values 0-63, high: 64-127), qh[32] (2 bits
        # per value: shifts 0, 2, 4, 6 for values 0-31, 32-63, 64-95, 96-127)
        low = _nibbles(ql, 64).reshape(n, 2, 128)
        high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        q = ((low | (high.reshape(n, 2, 128) << 4)).astype(np.int8) - 32).reshape(n, -1)
        bits, group = 8, 16
    else:
        raise ValueError(kind)
    q = np.ascontiguousarray(q).reshape(out, width)
    # 4 bits: QuantWeight's packing (model/quant.py pack_int4), formed in numpy: two values a byte,
    # the even column in the low nibble
    q = torch.from_numpy(q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else torch.from_numpy(q.view(np.int8))
    to_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(out, width // group))
    return QuantWeight(q, to_rows(scale), None if offset is None else to_rows(offset), bits, group, kind)
