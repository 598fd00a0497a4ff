"""The paged pool's geometry: the one place block size, bytes per block, the V offset and the number
of blocks are computed (tiny-vllm's BLOCK_BYTES and V_OFFSET), and the `-D` defines every CUDA
kernel gets them as."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedcli.core.errors import UsageError, plural
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.core.options import EngineOptions

DEFAULT_BLOCK_SIZE = EngineOptions.block_size
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)  # the kernels unroll over these


@dataclass(frozen=True)
class CacheGeometry:
    """The paged KV pool, tiny-vllm's layout: one pool of `num_blocks` physical blocks; a block holds
    K for `block_size` tokens ([block_size][kv_heads][head_dim]) and then V at `v_offset` bytes.
    Every layer takes its own blocks from the same pool.

    `dtype` is the model's (what attention computes in); the pool stores `kv_dtype`: the same, or
    float8_e4m3fn for an fp8 KV cache (`cache_dtype`; model/fp8.py), the same layout with 1-byte
    elements. Every byte count here is the pool's real one."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_blocks: int
    dtype: torch.dtype
    cache_dtype: torch.dtype | None = None  # None: the model dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype == FP8_DTYPE

    @property
    def kv_dtype_name(self) -> str:
        """What the pool stores, as shown: `bfloat16`, or `float8_e4m3fn` (scaled, for a bfloat16 model)."""
        name = str(self.kv_dtype).removeprefix("torch.")
        return f"{name} (scaled, for {str(self.dtype).removeprefix('torch.')})" if self.kv_fp8 else name

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes of one stored K/V element."""
        return self.kv_dtype.itemsize

    @property
    def v_offset(self) -> int:  # bytes from the start of a block to its V half
        return self.block_size * self.kv_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return 2 * self.v_offset

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_bytes_per_token(self) -> int:  # all layers, K and V
        return 2 * self.kv_dim * self.itemsize * self.num_layers

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_tokens(self) -> int:
        """The longest sequence the pool holds: one sequence alone, every layer's blocks."""
        return (self.num_blocks // self.num_layers) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks a sequence of `num_tokens` occupies in one layer."""
        return math.ceil(num_tokens / self.block_size)

    def defines(self) -> dict[str, int]:
        """The `-D` defines every CUDA kernel is compiled with."""
        return {
            "BLOCK_SIZE": self.block_size,
            "NUM_KV_HEADS": self.num_kv_heads,
            "HEAD_DIM": self.head_dim,
            "KV_DIM": self.kv_dim,
            "BLOCK_BYTES": self.block_bytes,
            "V_OFFSET": self.v_offset,
        }

    @classmethod
    def build(
        cls,
        config,
        dtype: torch.dtype,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        cache_bytes: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> "CacheGeometry":
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise UsageError(
                f"`block_size` {block_size} is not supported",
                f"choose one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))}",
            )
        geo = cls(block_size, config.num_kv_heads, config.head_dim, config.num_layers, 0, dtype, cache_dtype)
        if num_blocks is None:
            if cache_bytes is None:
                raise ValueError("give num_blocks or cache_bytes")
            num_blocks = cache_bytes // geo.block_bytes
        geo = cls(block_size, config.num_kv_heads, config.head_dim, config.num_layers, int(num_blocks), dtype, cache_dtype)
        if geo.num_blocks < config.num_layers:
            raise UsageError(
                f"a pool of {plural(geo.num_blocks, 'block')} cannot hold one block per layer ({plural(config.num_layers, 'layer')})",
                f"use `num_blocks` {config.num_layers * 8} or more, or a larger `cache_size`",
            )
        return geo


def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or not 0 < value < float("inf"):  # (nan fails the comparison too)
        raise UsageError(f"`cache_size` {text!r} is not a size", "write it like 2GiB, 512MiB or 100MB")
    return int(value * units[unit])
