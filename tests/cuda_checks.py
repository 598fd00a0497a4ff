"""What the CUDA kernel tests (tests/test_cuda_*.py) share: the cache they set up (Setup) in the
geometries they name (GEOMETRIES, Geometry), the poisons, and the checks against the references.
They test the CUDA backend's kernels against the torch reference backend, on the same cache (the
same pool tensor and block table), on a GPU.

Pools hold random numbers (never zeros) and blocks are handed out in shuffled order, so a kernel
that ignores the block table, the layer or the slot cannot pass. Outputs are poisoned with NaN
before the kernels run (through the caching allocator, and the split-KV scratch directly), so an
element a kernel forgets to write shows up.

Tolerances:
- RoPE + K/V write, silu_mul: the kernels round exactly where torch rounds,
  and the products/sums involved are exact in fp32 before that rounding, so we expect identical
  bits. We allow one unit in the last place (a different but correct rounding of an fp32 result,
  e.g. expf implementations) and require >= 99.9 % of the elements to be bit-identical.
- rms_norm's output: the fp32 sum of squares is accumulated in another order than torch's
  and rsqrtf may differ by an ulp, which can move the rounded normalised value by one bf16 ulp, and
  the weight multiply by one more: 2 ulps (relative 2^-6 in bf16) and >= 99 % identical.
- decode attention: ours accumulates in fp32 and rounds once, so against an fp64 reference it is
  within half an ulp of the output dtype plus fp32 noise: |diff| <= 2^-8 |ref| + 1e-4 max|ref| (bf16,
  fp16), 1e-5 relative (fp32). The torch reference (SDPA in bf16) itself rounds scores and
  probabilities to bf16 (relative errors ~2^-8 per term), so against it we only ask
  max |diff| <= 2e-2 max |ref|.
- gemv (a GEMM with its RMSNorm, silu-mul or residual add): the input it stages rounds as above; the
  products accumulate in fp32 in an order of their own, so against an fp64 product of the same
  staged input the result is within an ulp of the dtype plus fp32 accumulation error (bounded by
  K * 2^-24 * sum |w x|), and mostly identical after rounding. Its silu-mul epilogue sums gate and
  up exactly as its plain output does, so that one is held to silu_mul's tolerance.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedcli.backends.cuda import cuda_available
from pagedcli.model.config import ModelConfig

_OK, _WHY = cuda_available()

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    from pagedcli.backends.cuda import CudaBackend
    from pagedcli.backends.cuda_launch import LaunchShapes
    from pagedcli.backends.torch import TorchBackend
    from pagedcli.core.batch import StepBatch
    from pagedcli.core.geometry import CacheGeometry
    from pagedcli.engine.cache import KVCache

DEVICE = "cuda"
LENGTHS = (1, 15, 16, 17, 1000, 4097)


@dataclass(frozen=True)
class Geometry:
    """A test model's attention (query heads, KV heads, head size, dtype) and its cache's block size."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


# by name (each test's id); the first six: GQA ratios 4, 8, 1, 2, 8, 4
GEOMETRIES = {
    # Llama-3.2-1B: GQA 4
    "llama1b": Geometry(num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16),
    "gqa8-d128-b32": Geometry(num_heads=32, num_kv_heads=4, head_dim=128, block_size=32, dtype=torch.bfloat16),
    # GQA 1
    "mha-d64": Geometry(num_heads=8, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16),
    # stories260K: head_dim 8 in fp32
    "stories-fp32": Geometry(num_heads=8, num_kv_heads=4, head_dim=8, block_size=16, dtype=torch.float32),
    # a 16-byte row: one lane per token
    "d8-bf16-b32": Geometry(num_heads=8, num_kv_heads=1, head_dim=8, block_size=32, dtype=torch.bfloat16),
    "fp16": Geometry(num_heads=16, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float16),
    # the head geometries of the presets (pagedcli/data/presets): GQA 1, 3, 4, 8 at head_dim 64 and 128
    # Llama-3.2-3B
    "llama3b-gqa3-d128": Geometry(num_heads=24, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16),
    # Llama-3.1-8B
    "llama8b-gqa4-d128": Geometry(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16),
    # Llama-2-7B, CodeLlama-7B, DeepSeek-Coder-1.3B (16)
    "llama2-mha-d128": Geometry(num_heads=32, num_kv_heads=32, head_dim=128, block_size=16, dtype=torch.bfloat16),
    # TinyLlama-1.1B
    "tinyllama-gqa8-d64": Geometry(num_heads=32, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16),
    # SmolLM2-135M (and 360M: 15 / 5)
    "smollm-gqa3-d64": Geometry(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16),
    # OpenLLaMA-3B: decode attention as torch ops
    "openllama-d100": Geometry(num_heads=32, num_kv_heads=32, head_dim=100, block_size=16, dtype=torch.bfloat16),
    # an odd row count per warp in fp32
    "mha-d64-fp32": Geometry(num_heads=8, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.float32),
    "gqa16-d80-fp16": Geometry(num_heads=32, num_kv_heads=2, head_dim=80, block_size=16, dtype=torch.float16),
    "gqa2-d256": Geometry(num_heads=8, num_kv_heads=4, head_dim=256, block_size=16, dtype=torch.bfloat16),
}

# GQA 9 to 15: the upper half of the tensor-core decode kernel's 16-row tile holds heads, but not
# all 8 of its rows (only the decode tests on tensor cores take it)
PARTIAL_TILE_GEOMETRIES = {
    "gqa12-d64": Geometry(num_heads=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16),
}

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
ACCUMULATION_FP8 = 2.0**-12  # fp8 tensor cores' sums, relative to the terms' magnitudes (test_fp8_gemm_...)


class Shape(NamedTuple):
    """A weight's shape: N output rows by K inputs (`N, K = shape`)."""
    n: int
    k: int


# (new tokens, tokens cached before them) per sequence of one prefill step
PREFILL_CASES = {
    "prompts": [(1, 0), (15, 0), (16, 0), (17, 0), (100, 0), (1000, 0), (64, 0), (65, 0)],
    "cached prefixes and decode rows": [(13, 20), (1, 64), (50, 128), (64, 64), (1, 1), (200, 37), (1, 999)],
    # as the scheduler orders a mixed step: the decoding rows first (the decode kernel's), then chunks
    "decode rows first": [(1, 64), (1, 999), (1, 0), (1, 300), (13, 20), (50, 128), (1, 37), (200, 37)],
    # too few tiles to fill the GPU: their keys split into parts (cuda_launch.key_parts), merged by the last
    "short chunks after long prefixes": [(1, 700), (60, 4000), (37, 1500)],
}


def make_config(num_heads, num_kv_heads, head_dim, dtype, num_layers=2, max_len=8192) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": num_heads * head_dim, "intermediate_size": 3 * num_heads * head_dim,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "vocab_size": 64, "max_position_embeddings": max_len,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }, source="test")


class Setup:
    """A cache on the GPU with random contents, sequences of the given lengths in shuffled blocks,
    and both backends over it."""

    def __init__(self, geometry: str, lengths, max_model_len=8192, seed=0, spare_slots=0, block_size=None,
                 fp8_weights=False):
        g = {**GEOMETRIES, **PARTIAL_TILE_GEOMETRIES}[geometry]
        block_size = block_size or g.block_size
        self.dtype = dtype = g.dtype
        self.config = make_config(g.num_heads, g.num_kv_heads, g.head_dim, dtype, max_len=max_model_len)
        blocks = sum(math.ceil(n / block_size) for n in lengths) * self.config.num_layers + 64
        geo = CacheGeometry.build(self.config, dtype, block_size, num_blocks=blocks)
        num_slots = len(lengths) + spare_slots
        self.cache = KVCache(geo, num_slots, max_model_len, device=DEVICE, shuffle_seed=seed)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.cache.store.pool.copy_(torch.randn(self.cache.store.pool.shape, generator=gen, device=DEVICE, dtype=dtype))
        # slots in a scrambled order, so that sequence b is not slot b
        self.slots = random.Random(seed).sample(range(num_slots), len(lengths))
        for slot, n in zip(self.slots, lengths):
            self.cache.grow(slot, n)
        self.cache.sync_device_table()
        self.ref = TorchBackend(self.cache.store, self.config)
        self.cuda = CudaBackend(self.cache.store, self.config, fp8_weights=fp8_weights)  # (its plan's kernels only)
        self.gen = gen

    def randn(self, *shape, scale=1.0):
        return torch.randn(shape, generator=self.gen, device=DEVICE, dtype=torch.float32).mul_(scale).to(self.dtype)

    def decode_batch(self, lengths, slots=None):
        """Each sequence has lengths[b] - 1 tokens cached and feeds one more."""
        slots = self.slots[: len(lengths)] if slots is None else slots
        return StepBatch.build(False, slots, [[1]] * len(lengths), [n - 1 for n in lengths], torch.device(DEVICE))

    def qkv(self, T):
        """q, k, v as llama.py makes them: column slices of one fused projection output."""
        c = self.config
        qkv = self.randn(T, c.q_dim + 2 * c.kv_dim)
        q, k, v = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        return (q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                v.view(T, c.num_kv_heads, c.head_dim))


def poison_allocator(*shapes, dtype):
    """Make the caching allocator's next blocks of these sizes hold NaN: allocate, fill, free."""
    tensors = [torch.full(s, float("nan"), dtype=dtype, device=DEVICE) for s in shapes]
    del tensors


def poison_scratch(backend):
    """NaN into the split-KV partials of decode and prefill (the merge counters must stay zero)."""
    for _, *buffers, _counters in backend.shapes.split_scratch.values():
        for b in buffers:
            b.fill_(float("nan"))
    if backend.prefill_kernel:
        for b in backend._prefill_scratch[:3]:
            b.fill_(float("nan"))


def assert_prefill_counters_reset(backend):
    """The last part of each split prefill tile reset its merge counter (for the next layer, or a
    graph's replay)."""
    if backend.prefill_kernel:
        assert not backend._prefill_scratch[3].any(), "a prefill merge counter was left counting"


def forbid_torch_fallback(monkeypatch, method):
    """From now on, the CUDA backend may not quietly hand `method` to the torch reference."""
    def fail(*args, **kwargs):
        raise AssertionError(f"CudaBackend.{method} fell back to torch")
    monkeypatch.setattr(TorchBackend, method, fail)


def assert_ulp_close(actual, expected, ulps=1.0, min_identical=0.999):
    """Within `ulps` units in the last place of the dtype (relative), and mostly bit-identical."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all(), "non-finite values"
    tol = ulps * ULP[actual.dtype] * e.abs() + 1e-30
    bad = (a - e).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {ulps} ulp; worst {(a - e).abs().max().item()}"
    identical = (a == e).float().mean().item()
    assert identical >= min_identical, f"only {identical:.4%} bit-identical"


def reference_attention_fp64(setup, layer, q, lengths, slots):
    """Decode attention in float64, reading the pool through the host block table."""
    geo = setup.cache.geometry
    gqa = setup.config.num_heads // setup.config.num_kv_heads
    out = []
    for b, (n, slot) in enumerate(zip(lengths, slots)):
        blocks = torch.as_tensor(setup.cache.table[slot, layer, : math.ceil(n / geo.block_size)], device=DEVICE).long()
        kv = setup.cache.store.pool[blocks].double()  # [blocks, 2, block_size, kv_heads, D]
        k = kv[:, 0].reshape(-1, geo.num_kv_heads, geo.head_dim)[:n].repeat_interleave(gqa, dim=1)
        v = kv[:, 1].reshape(-1, geo.num_kv_heads, geo.head_dim)[:n].repeat_interleave(gqa, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) / math.sqrt(geo.head_dim)
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(out)


def assert_attention_close(out, ref64, ref_torch):
    assert torch.isfinite(out).all()
    o, r = out.double(), ref64
    if out.dtype == torch.float32:
        bound = 1e-5 * r.abs() + 1e-5 * r.abs().max()
    else:
        bound = 2.0**-8 * r.abs() + 1e-4 * r.abs().max()
    worst = ((o - r).abs() - bound).max().item()
    assert worst <= 0, f"off the fp64 reference by {worst} beyond the bound"
    loose = (out.float() - ref_torch.float()).abs().max().item()
    assert loose <= 2e-2 * ref_torch.float().abs().max().item(), f"off the torch reference by {loose}"


DECODE_MMA = "paged_attention_decode_mma"


def assert_decode_close(out, ref64, ref_torch, launched):
    """A decode step's output against float64 and the torch reference, to the bound of the kernel
    that `launched`: paged_decode_mma.cu rounds P to the element type before P V, so the prefill
    kernel's."""
    if launched != [DECODE_MMA]:
        return assert_attention_close(out, ref64, ref_torch)
    assert torch.isfinite(out).all()
    assert_prefill_close(out, ref64)
    loose = (out.float() - ref_torch.float()).abs().max().item()
    assert loose <= 2e-2 * ref_torch.float().abs().max().item(), f"off the torch reference by {loose}"


def assert_prefill_close(out, ref64):
    """P is rounded to the element type before P V (as FlashAttention and SDPA do): the output is
    within a few of the dtype's ulps of the float64 result, relative to the largest output."""
    bound = (2e-6 if out.dtype == torch.float32 else 8 * ULP[out.dtype]) * ref64.abs().max().item()
    worst = (out.double() - ref64).abs().max().item()
    assert worst <= bound, f"off the fp64 reference by {worst} (bound {bound})"


def same_split_k_as_fused(monkeypatch, s, weight):
    """A fused kernel that pairs rows (silu-mul, RoPE) has half as many units of work as the plain
    one on the same weight, so it may split K over more warps, and sum in another order. Where a
    test asks for the plain kernel's exact sums, both use the fused kernel's split."""
    split = s.cuda.shapes.gemv_split(weight.shape[0] // 2, weight.shape[1], weight.element_size())
    monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)
