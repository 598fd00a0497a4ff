"""The fp8 KV cache's kernels on a GPU (`kv_cache_dtype` fp8, model/fp8.py): the e4m3 K/V write
(kv_write.cu, gemv.cu's qkv epilogue) bit for bit against the torch reference's quantize_kv, decode
and prefill attention over e4m3 pools whose scales are not 1.0 against float64 (the e4m3 values
times their scales) and against the torch backend on the same pool, and whole engines: the CUDA
backend against the torch backend on the same GPU.

Pools hold e4m3 values of a normal distribution (subnormals to a few hundred), in shuffled blocks
and scrambled slots, with a different scale per layer and KV head, so a kernel that ignores the
table, the layer, the head's scale or a factor of the conversion cannot pass. Tolerances are
cuda_checks.py's: the kernels dequantize exactly (every e4m3 value is a bf16 and an fp16
number) and fold the scales into the softmax and the output, so against float64 they are held to
the bounds of the model-dtype kernels; the torch reference rounds each dequantized element to the
model dtype first (relative 2^-9), so against it only to the loose bound.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import hf_checkpoint
from helpers import record_logits, rope_kernel, spy_launches, use_rope_width
from pagedcli.backends.cuda import cuda_available
from cuda_checks import LENGTHS, PREFILL_CASES, Geometry

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    import pagedcli.backends.cuda_build as cuda_build
    import pagedcli.backends.cuda_launch as cuda_launch
    from pagedcli.backends.cuda import CudaBackend
    from pagedcli.backends.torch import TorchBackend
    from pagedcli.core.batch import StepBatch
    from pagedcli.engine.cache import KVCache
    from pagedcli.core.options import SamplingParams
    from pagedcli.core.geometry import CacheGeometry
    from pagedcli.core.fp8 import FP8_DTYPE, KVScales, quantize_kv, raw, to_fp8
    from pagedcli.engine.build import build_engine, load_model
    from pagedcli.core.options import EngineOptions
    from cuda_checks import (assert_decode_close, assert_prefill_close, assert_prefill_counters_reset,
                                   assert_ulp_close, forbid_torch_fallback, make_config, poison_allocator, poison_scratch,
                                   same_split_k_as_fused)

DEVICE = "cuda"

# GQA 1, 3, 4, 8 at head_dim 64 and 128, block sizes 8 to 64, bf16 and fp16, and stories260K's
# head_dim 8 in bf16 (one 8-byte e4m3 load a row), and in float32 (the decode kernel only: float32
# prefill takes the torch path)
GEOMETRIES = {
    # Llama-3.2-1B
    "gqa4-d64": Geometry(num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16),
    "gqa1-d64-b8": Geometry(num_heads=8, num_kv_heads=8, head_dim=64, block_size=8, dtype=torch.bfloat16),
    # Llama-3.2-3B's heads
    "gqa3-d128-b32": Geometry(num_heads=24, num_kv_heads=8, head_dim=128, block_size=32, dtype=torch.bfloat16),
    "gqa8-d128-b64": Geometry(num_heads=32, num_kv_heads=4, head_dim=128, block_size=64, dtype=torch.bfloat16),
    "gqa1-d128": Geometry(num_heads=16, num_kv_heads=16, head_dim=128, block_size=16, dtype=torch.bfloat16),
    "gqa8-d64-fp16": Geometry(num_heads=32, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float16),
    "gqa3-d128-fp16": Geometry(num_heads=12, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.float16),
    "d8-bf16": Geometry(num_heads=8, num_kv_heads=4, head_dim=8, block_size=16, dtype=torch.bfloat16),
    "d8-fp32": Geometry(num_heads=8, num_kv_heads=4, head_dim=8, block_size=16, dtype=torch.float32),
}
TENSOR_CORE = [name for name, g in GEOMETRIES.items() if g.dtype != torch.float32]


class Setup:
    """An fp8 pool on the GPU with e4m3 contents, per-layer-and-head scales, sequences of the
    given lengths in shuffled blocks, and both backends over it."""

    def __init__(self, geometry: str, lengths, max_model_len=8192, seed=0):
        g = GEOMETRIES[geometry]
        num_heads, num_kv_heads, head_dim, block_size, dtype = (g.num_heads, g.num_kv_heads, g.head_dim, g.block_size,
                                                                g.dtype)
        self.dtype = dtype
        self.config = make_config(num_heads, num_kv_heads, head_dim, dtype, max_len=max_model_len)
        layers = self.config.num_layers
        blocks = sum(math.ceil(n / block_size) for n in lengths) * layers + 64
        geo = CacheGeometry.build(self.config, dtype, block_size, num_blocks=blocks, cache_dtype=FP8_DTYPE)
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        scales = KVScales(*(torch.rand((layers, num_kv_heads), generator=self.gen, device=DEVICE) * 0.1 + 0.02
                            for _ in "kv"))
        self.cache = KVCache(geo, len(lengths), max_model_len, device=DEVICE, shuffle_seed=seed, kv_scales=scales)
        values = torch.randn(self.cache.store.pool.shape, generator=self.gen, device=DEVICE) * 16
        raw(self.cache.store.pool).copy_(raw(to_fp8(values)))
        self.slots = random.Random(seed).sample(range(len(lengths)), len(lengths))
        for slot, n in zip(self.slots, lengths):
            self.cache.grow(slot, n)
        self.cache.sync_device_table()
        self.ref = TorchBackend(self.cache.store, self.config)
        self.cuda = CudaBackend(self.cache.store, self.config)
        assert not self.cuda.fallbacks.keys() & {"RoPE and the K/V write", "decode attention"}, self.cuda.fallbacks

    def randn(self, *shape, scale=1.0):
        return torch.randn(shape, generator=self.gen, device=DEVICE, dtype=torch.float32).mul_(scale).to(self.dtype)

    def qkv(self, T):
        c = self.config
        q, k, v = self.randn(T, c.q_dim + 2 * c.kv_dim).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        return (q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                v.view(T, c.num_kv_heads, c.head_dim))

    def kv64(self, layer: int, slot: int, n: int):
        """The first n keys and values of a sequence, dequantized in float64 and repeated for GQA:
        [n, num_heads, head_dim] each."""
        geo = self.cache.geometry
        gqa = self.config.num_heads // geo.num_kv_heads
        blocks = torch.as_tensor(self.cache.table[slot, layer, : math.ceil(n / geo.block_size)], device=DEVICE).long()
        kv = raw(self.cache.store.pool)[blocks].view(FP8_DTYPE).float().double()  # [blocks, 2, block_size, kv_heads, D]
        scales = self.cache.store.kv_scales
        out = []
        for i, scale in enumerate((scales.k[layer], scales.v[layer])):
            x = kv[:, i].reshape(-1, geo.num_kv_heads, geo.head_dim)[:n] * scale.double()[None, :, None]
            out.append(x.repeat_interleave(gqa, dim=1))
        return out


def same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per byte of two e4m3 tensors: equal, or both NaN (0x7f / 0xff: a NaN's sign is the GPU's
    arithmetic's to choose, before the conversion)."""
    a, e = raw(actual), raw(expected)
    nan = lambda x: (x & 0x7f) == 0x7f  # noqa: E731
    return (a == e) | (nan(a) & nan(e))


# --- the K/V write ------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("width", ["vectors", "elements"])
def test_kv_write_is_the_references_quantize_bit_for_bit(geometry, phase, width, monkeypatch):
    """RoPE'd k and v into an fp8 pool: every byte the torch reference writes (e4m3 of the exact
    quotient by the head's scale, saturated), nothing else touched; q as the model-dtype kernel's."""
    use_rope_width(monkeypatch, width)
    prompt = [1, 15, 16, 17, 100]
    s = Setup(geometry, [n + 20 for n in prompt] + [60], seed=1)
    if phase == "prefill":  # whole prompts, plus one sequence continuing a cached prefix of 20 tokens
        batch = StepBatch.build(True, s.slots, [[1] * n for n in prompt + [13]], [0] * len(prompt) + [20],
                                torch.device(DEVICE))
    else:
        batch = StepBatch.build(False, s.slots, [[1]] * 6, [n + 19 for n in prompt] + [59], torch.device(DEVICE))
    T = batch.token_ids.numel()
    q, k, v = s.qkv(T)
    k, v = k * 20, v * 20  # past 448 times the smallest scales: the saturation is written too
    layer = 1
    before = raw(s.cache.store.pool).clone()  # (fp8 tensors are gathered and copied as their bytes)
    s.ref.prepare(batch)
    q_ref = s.ref.rope_write_kv(layer, q, k, v, batch)
    pool_ref = raw(s.cache.store.pool).clone()
    assert (raw(pool_ref) == 0x7e).any() or (raw(pool_ref) == 0xfe).any()

    raw(s.cache.store.pool).copy_(before)
    poison_allocator(q_ref.shape, dtype=s.dtype)
    s.cuda.prepare(batch)
    launched = spy_launches(s.cuda)
    q_cuda = s.cuda.rope_write_kv(layer, q, k, v, batch)
    torch.cuda.synchronize()
    assert launched == [rope_kernel(s, width)]
    assert_ulp_close(q_cuda, q_ref)
    assert not torch.equal(raw(s.cache.store.pool), raw(before))
    assert torch.equal(raw(s.cache.store.pool), raw(pool_ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_write_quantizes_every_16_bit_value_as_torch_does(dtype):
    """V is quantized without RoPE in between: all 65,536 bit patterns of the model dtype (NaN,
    inf, subnormals, past 448 times the scale) through kv_write.cu, against quantize_kv on the same
    GPU, with scales per head from 2^-10 to 3."""
    geometry = "gqa1-d64-b8" if dtype == torch.bfloat16 else "gqa8-d64-fp16"
    kv_heads, head_dim = GEOMETRIES[geometry].num_kv_heads, GEOMETRIES[geometry].head_dim
    T = (1 << 16) // (kv_heads * head_dim)  # tokens whose V elements are the 65,536 patterns
    s = Setup(geometry, [T], max_model_len=T)
    c, layer = s.config, 0
    s.cache.store.kv_scales.v[layer] = torch.logspace(-10, math.log2(3), c.num_kv_heads, base=2, device=DEVICE)
    q, k, _ = s.qkv(T)
    v = torch.arange(1 << 16, dtype=torch.int32, device=DEVICE).to(torch.int16).view(dtype).view(T, c.num_kv_heads,
                                                                                                 c.head_dim)
    batch = StepBatch.build(True, s.slots[:1], [[1] * T], [0], torch.device(DEVICE))
    s.cuda.prepare(batch)
    s.cuda.rope_write_kv(layer, q, k, v, batch)
    torch.cuda.synchronize()
    blocks = torch.as_tensor(s.cache.table[s.slots[0], layer, : T // s.cache.geometry.block_size], device=DEVICE).long()
    written = raw(s.cache.store.pool)[blocks, 1].reshape(T, c.num_kv_heads, c.head_dim)
    want = quantize_kv(v, s.cache.store.kv_scales.v[layer])
    ok = same_bytes(written, want)
    bad = (~ok).nonzero()
    assert ok.all(), [(v[tuple(i)].item(), hex(raw(written)[tuple(i)].item()), hex(raw(want)[tuple(i)].item()))
                      for i in bad[:8].tolist()]


def test_software_e4m3_conversion_matches_torch_on_the_gpu():
    """fp8.cuh's conversion for GPUs before sm_89 (what an A100 runs), compiled for this GPU:
    every bf16 and fp16 value over a few scales and a million random float32 bit patterns, against
    torch's cast of the clamped value (NaN's sign aside) and against the hardware's."""
    import cupy

    from pagedcli.backends.cuda_compile import kernel_source

    source = kernel_source("fp8.cuh") + """
    extern "C" __global__ void convert(const float* x, unsigned char* soft, unsigned char* hard, long long n) {
        const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        if (i < n) { soft[i] = (unsigned char)e4m3_from_float_software(x[i]); hard[i] = (unsigned char)e4m3_from_float(x[i]); }
    }"""
    kernel = cupy.RawModule(code=source, options=("-std=c++17", "-DDTYPE_BF16")).get_function("convert")
    every16 = torch.arange(1 << 16, dtype=torch.int32, device=DEVICE).to(torch.int16)
    values = [every16.view(torch.bfloat16).float(), every16.view(torch.float16).float()]
    values = [x / s for x in values for s in (1.0, 0.37, 3e-3, 2.0**-12, 17.0)]
    values.append(torch.randint(-(1 << 31), 1 << 31, (1 << 20,), device=DEVICE, dtype=torch.int64).to(torch.int32)
                  .view(torch.float32))
    x = torch.cat(values).contiguous()
    soft, hard = (torch.empty(x.shape, dtype=torch.uint8, device=DEVICE) for _ in range(2))
    n = x.numel()
    torch.cuda.synchronize()  # the inputs are written (on torch's stream) before CuPy's launch reads them
    kernel(((n + 255) // 256,), (256,), (cupy.uint64(x.data_ptr()), cupy.uint64(soft.data_ptr()),
                                          cupy.uint64(hard.data_ptr()), cupy.int64(n)))
    cupy.cuda.runtime.deviceSynchronize()
    want = to_fp8(x)
    assert same_bytes(soft, want).all() and same_bytes(hard, want).all()


@pytest.mark.parametrize("geometry", ["gqa4-d64", "gqa8-d128-b64", "d8-fp32"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_fused_qkv_epilogue_writes_the_bytes_kv_write_does(geometry, phase, monkeypatch):
    """gemv.cu's qkv epilogue (RoPE and the K/V write at 1 and 2 rows) quantizes as kv_write.cu:
    the same q, the same pool bytes (a padding row writes nothing)."""
    lengths = [40, 300]
    s = Setup(geometry, lengths, seed=14)
    c, layer = s.config, 1
    if phase == "decode":
        batch = StepBatch.build(False, s.slots, [[1]] * 2, [n - 1 for n in lengths], torch.device(DEVICE))
        batch.positions[1], batch.context_lens[1] = -1, 0  # a padding row
    else:
        batch = StepBatch.build(True, s.slots[:1], [[5, 6]], [38], torch.device(DEVICE))
    T = batch.token_ids.shape[0]
    x = s.randn(T, c.hidden_size, scale=2.0)
    qkv = s.randn(c.q_dim + 2 * c.kv_dim, c.hidden_size, scale=c.hidden_size**-0.5)
    norm_weight = s.randn(c.hidden_size) + 1
    pool0 = raw(s.cache.store.pool).clone()

    s.cuda.prepare(batch)
    same_split_k_as_fused(monkeypatch, s, qkv)
    q, k, v = s.cuda.norm_linear(x, norm_weight, qkv, 1e-5).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q_ref = s.cuda.rope_write_kv(layer, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                                 v.view(T, c.num_kv_heads, c.head_dim), batch)
    torch.cuda.synchronize()
    pool_ref = raw(s.cache.store.pool).clone()
    assert not torch.equal(raw(pool_ref), raw(pool0))

    raw(s.cache.store.pool).copy_(pool0)
    forbid_torch_fallback(monkeypatch, "attention_inputs")
    forbid_torch_fallback(monkeypatch, "rope_write_kv")
    q_fused = s.cuda.attention_inputs(layer, x, norm_weight, qkv, 1e-5, batch)
    torch.cuda.synchronize()
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(raw(s.cache.store.pool), raw(pool_ref))


# --- decode attention ---------------------------------------------------------------------------

def reference_decode64(s: Setup, layer, q, lengths, slots):
    out = []
    for b, (n, slot) in enumerate(zip(lengths, slots)):
        k, v = s.kv64(layer, slot, n)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) / math.sqrt(s.config.head_dim)
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def decode_case(geometry, lengths, max_model_len, seed, monkeypatch, layer=1):
    s = Setup(geometry, lengths, max_model_len=max_model_len, seed=seed)
    batch = StepBatch.build(False, s.slots, [[1]] * len(lengths), [n - 1 for n in lengths], torch.device(DEVICE))
    q = s.randn(len(lengths), s.config.num_heads, s.config.head_dim, scale=2.0)
    s.ref.prepare(batch)
    ref_torch = s.ref.attend(layer, q, batch)
    forbid_torch_fallback(monkeypatch, "attend")
    s.cuda.prepare(batch)
    poison_scratch(s.cuda)
    poison_allocator(q.shape, dtype=s.dtype)
    s.launched = spy_launches(s.cuda)
    out = s.cuda.attend(layer, q, batch)
    torch.cuda.synchronize()
    assert_decode_close(out, reference_decode64(s, layer, q, lengths, s.slots), ref_torch, s.launched)
    return s


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_decode_attention_over_an_fp8_pool(geometry, monkeypatch):
    decode_case(geometry, list(LENGTHS), max_model_len=4200, seed=2, monkeypatch=monkeypatch)


@pytest.mark.parametrize("geometry", ["gqa4-d64", "gqa3-d128-b32"])
def test_decode_attention_fp8_batch_64_and_one_split(geometry, monkeypatch):
    """Many sequences (few splits, spans of several chunks merged online), then one CTA per
    (sequence, head group) walking every chunk: the V scale is applied once, after the merges.
    The split-KV kernel's (paged_attention.cu): the tensor-core kernel is not built."""
    monkeypatch.setattr(cuda_build, "DECODE_MMA_KERNEL", False)
    decode_case(geometry, random.Random(3).choices(LENGTHS, k=64), max_model_len=8192, seed=3, monkeypatch=monkeypatch)
    monkeypatch.undo()  # the first case forbade the torch reference, which the second one's reference is
    monkeypatch.setattr(cuda_build, "DECODE_MMA_KERNEL", False)
    monkeypatch.setattr(cuda_launch, "SPLIT_CTAS_PER_SM", 0)
    s = decode_case(geometry, [4097, 1000, 1, 513], max_model_len=8192, seed=5, monkeypatch=monkeypatch)
    assert s.cuda.shapes.num_splits(4) == 1 and s.launched == ["paged_attention_decode"]


@pytest.mark.parametrize("geometry", TENSOR_CORE)
def test_decode_attention_fp8_on_tensor_cores(geometry, monkeypatch):
    """paged_decode_mma.cu over an fp8 pool (one CTA per sequence and kv head: its warps' e4m3 rings
    converted to the model dtype tile by tile, the head's K scale in the softmax's, its V scale in
    the normalisation): contexts of 1 key to 4,097, on both sides of a tile, a block and a round
    of the warps' tiles, every geometry of this file in bf16 and fp16 (head_dim 8's single 8-byte
    rows among them); then batch 64 as the engine runs it on an H200."""
    monkeypatch.setattr(cuda_launch, "SPLIT_CTAS_PER_SM", 0)
    lengths = list(LENGTHS) + [31, 32, 33, 63, 64, 65, 129]
    s = decode_case(geometry, lengths, max_model_len=4200, seed=12, monkeypatch=monkeypatch)
    assert s.launched == ["paged_attention_decode_mma"], s.launched
    monkeypatch.undo()
    s = decode_case(geometry, random.Random(3).choices(LENGTHS, k=64), max_model_len=8192, seed=3,
                    monkeypatch=monkeypatch)
    assert s.launched == [s.cuda.decode_kernel(64)]


# --- prefill attention --------------------------------------------------------------------------

def reference_prefill64(s: Setup, layer, q, seqs, slots, rows=None):
    out, start = [], 0
    for (n, cached), slot in zip(seqs, slots):
        ctx = n + cached
        k, v = s.kv64(layer, slot, ctx)
        first = max(0, n - rows) if rows else 0
        scores = torch.einsum("qhd,thd->hqt", q[start + first:start + n].double(), k) / math.sqrt(s.config.head_dim)
        pos = cached + torch.arange(first, n, device=DEVICE)
        scores = scores.masked_fill(torch.arange(ctx, device=DEVICE)[None, None, :] > pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqt,thd->qhd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


def prefill_case(geometry, seqs, monkeypatch, seed=7, layer=1):
    lengths = [n + c for n, c in seqs]
    s = Setup(geometry, lengths, max_model_len=max(lengths) + 16, seed=seed)
    assert s.cuda.prefill_kernel, s.cuda.fallbacks
    batch = StepBatch.build(True, s.slots, [[1] * n for n, _ in seqs], [c for _, c in seqs], torch.device(DEVICE))
    q = s.randn(sum(n for n, _ in seqs), s.config.num_heads, s.config.head_dim, scale=2.0)
    s.ref.prepare(batch)
    ref_torch = s.ref.attend(layer, q, batch)
    forbid_torch_fallback(monkeypatch, "attend")
    s.cuda.prepare(batch)
    poison_scratch(s.cuda)
    poison_allocator(q.shape, dtype=s.dtype)
    out = s.cuda.attend(layer, q, batch)
    torch.cuda.synchronize()
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert_prefill_counters_reset(s.cuda)
    loose = (out.float() - ref_torch.float()).abs().max().item()
    assert loose <= 2e-2 * ref_torch.float().abs().max().item(), f"off the torch reference by {loose}"
    return s, q, out


@pytest.mark.parametrize("geometry", TENSOR_CORE)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention_over_an_fp8_pool(geometry, case, monkeypatch):
    """Prompts of 1 to 1,000 tokens, and chunks after cached prefixes (the prefix's e4m3 blocks
    are read like the new ones), short ones after long prefixes with their keys split."""
    seqs = PREFILL_CASES[case]
    s, q, out = prefill_case(geometry, seqs, monkeypatch)
    assert_prefill_close(out, reference_prefill64(s, 1, q, seqs, s.slots))


def test_prefill_attention_fp8_long_prompts(monkeypatch):
    """A few thousand tokens, after cached prefixes too: the last rows against float64."""
    seqs = [(4000, 0), (3000, 1000), (1, 4000), (2500, 96)]
    s, q, out = prefill_case("gqa4-d64", seqs, monkeypatch)
    rows = 40
    ref64 = reference_prefill64(s, 1, q, seqs, s.slots, rows=rows)
    ends = torch.cumsum(torch.tensor([n for n, _ in seqs]), 0).tolist()
    assert_prefill_close(torch.cat([out[e - min(rows, n):e] for e, (n, _) in zip(ends, seqs)]), ref64)


# --- whole engines ------------------------------------------------------------------------------

# bf16: the two backends sum in other orders (gemv.cu and cuBLAS, our attention and SDPA) and
# round each layer's results to bf16, so logits agree to about a percent of their largest; a
# token may differ only where the reference's two best are nearer than that (then the texts part)
LOGIT_RTOL, TIE_RTOL = 0.05, 0.02
# ... except at head_dim 8 (stories260K), where a score sums only 8 products: an e4m3 rounding step
# is up to 1/16 of a value, and a K/V element one bf16 unit apart in the two backends lands on the
# other side of a rounding boundary about one time in 16, which moves its score visibly. Measured on
# the CPU (docs/performance-log.md, FP8: the torch backend against itself with K/V elements nudged by
# one bf16 unit before the write, this test's prompts): 2-5% of the largest logit with a bf16 pool,
# 8-21% with an fp8 pool (head_dim 64: 1% and 2%). The bounds there are that noise's; the kernels
# themselves are held to float64's bounds at head_dim 8 above (the "d8-bf16" geometry).
D8_FP8_LOGIT_RTOL = D8_FP8_TIE_RTOL = 0.3


def assert_same_until_a_near_tie(tokens, want_tokens, logits, want_logits, logit_rtol=LOGIT_RTOL, tie_rtol=TIE_RTOL):
    for a, b, la, lb in zip(tokens, want_tokens, logits, want_logits):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            scale = lb[i].abs().max().item()
            worst = (la[i] - lb[i]).abs().max().item()
            assert worst <= logit_rtol * scale, f"step {i}: logits off by {worst} (largest {scale})"
            if x != y:
                gap = (lb[i][y] - lb[i][x]).item()
                assert gap <= tie_rtol * scale, f"step {i}: tokens {x} and {y} differ without a near-tie ({gap})"
                break


def run_both(opts, rounds, steps, **bounds):
    """The same model and options through our kernels and through the torch backend (on the same
    GPU, the same fp8 pool semantics), one round of prompts after the other (a later round's
    prompts start with an earlier one's: their prefix blocks are read from the prefix cache);
    tokens and logits compared."""
    model = load_model(opts)
    ours = build_engine(model, opts)
    assert ours.cache.store.pool.dtype == FP8_DTYPE
    assert not ours.runner.model.backend.fallbacks
    reference = build_engine(model, EngineOptions(**{**opts.__dict__, "eager": True}))
    reference.runner.model.backend = TorchBackend(reference.cache.store, model.source.config)
    seen = [record_logits(e) for e in (ours, reference)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
    for prompts in rounds:
        a, b = ([s for s in e.run_to_completion(prompts, params)] for e in (ours, reference))
        logits = [[torch.stack(got[s.id]).float().cpu() for s in seqs] for got, seqs in zip(seen, (a, b))]
        assert_same_until_a_near_tie([s.output_token_ids for s in a], [s.output_token_ids for s in b], *logits,
                                     **bounds)
    if len(rounds) > 1:
        assert ours.scheduler.cached_prompt_tokens > 0  # the prefill kernel read cached e4m3 blocks


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("head_dim,gqa", [(64, 4), (128, 3), (64, 1), (128, 8)])
def test_engine_fp8_pool_cuda_backend_equals_torch_backend(tmp_path, head_dim, gqa, eager):
    """bf16 model, fp8 pool, the same GPU: our kernels (CUDA graphs, or eager) against the torch
    backend's quantize and dequantize, greedy, at batch 1 (gemv.cu's fused write) and 3 (cuBLAS
    and kv_write.cu), a long prompt beside short ones, then a prompt that starts with the long one
    (its first blocks from the prefix cache)."""
    kv_heads = 2
    hidden = kv_heads * gqa * head_dim
    folder = hf_checkpoint(tmp_path / "m", num_attention_heads=kv_heads * gqa, num_key_value_heads=kv_heads,
                           head_dim=head_dim, hidden_size=hidden, intermediate_size=256, max_position_embeddings=512,
                           initializer_range=0.15 * (64 / hidden) ** 0.5)
    long = list(range(3, 3 + 70))
    for batch in (1, 3):
        prompts = [long, [5, 6, 7], [9] * 20][:batch]
        opts = EngineOptions(model=str(folder), device="cuda", dtype="bfloat16", batch=batch, shuffle_blocks=3,
                             kv_cache_dtype="fp8", eager=eager)
        run_both(opts, [prompts, [long[:48] + [7] * 10]], 24)


def test_engine_fp8_pool_stories260k_bf16(stories):
    """stories260K (head_dim 8: one 8-byte e4m3 load a row) in bf16 with an fp8 pool, CUDA graphs:
    our kernels against the torch backend on the GPU, to head_dim 8's bounds (D8_FP8_LOGIT_RTOL)."""
    prompts = [[1], [1, 403, 407, 261, 378], list(range(5, 45))]
    opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", batch=3, kv_cache_dtype="fp8",
                         shuffle_blocks=17, num_blocks=5 * 60)
    run_both(opts, [prompts], 60, logit_rtol=D8_FP8_LOGIT_RTOL, tie_rtol=D8_FP8_TIE_RTOL)
