"""The CUDA backend's kernels against the torch reference backend, on the same cache (the same pool
tensor and block table), on a GPU.

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

import pytest
import torch

from helpers import rope_kernel, spy_launches, use_rope_width
from pagedcli.backends import composed
from pagedcli.backends.cuda import cuda_available
from pagedcli.model.config import ModelConfig

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    import pagedcli.backends.cuda_build as cuda_build
    import pagedcli.backends.cuda_launch as cuda_launch
    from pagedcli.backends.cuda import CudaBackend
    from pagedcli.backends.cuda_gemv import gemv
    from pagedcli.backends.cuda_launch import LaunchShapes
    from pagedcli.backends.torch import TorchBackend
    from pagedcli.engine.batch import StepBatch
    from pagedcli.engine.cache import KVCache
    from pagedcli.model.config import CacheGeometry

DEVICE = "cuda"
LENGTHS = (1, 15, 16, 17, 1000, 4097)

# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 4, 8, 1, 2, 8, 4
GEOMETRIES = {
    "llama1b": (32, 8, 64, 16, torch.bfloat16),  # Llama-3.2-1B: GQA 4
    "gqa8-d128-b32": (32, 4, 128, 32, torch.bfloat16),
    "mha-d64": (8, 8, 64, 16, torch.bfloat16),  # GQA 1
    "stories-fp32": (8, 4, 8, 16, torch.float32),  # stories260K: head_dim 8 in fp32
    "d8-bf16-b32": (8, 1, 8, 32, torch.bfloat16),  # a 16-byte row: one lane per token
    "fp16": (16, 4, 64, 16, torch.float16),
    # the head geometries of the presets (pagedcli/data/presets): GQA 1, 3, 4, 8 at head_dim 64 and 128
    "llama3b-gqa3-d128": (24, 8, 128, 16, torch.bfloat16),  # Llama-3.2-3B
    "llama8b-gqa4-d128": (32, 8, 128, 16, torch.bfloat16),  # Llama-3.1-8B
    "llama2-mha-d128": (32, 32, 128, 16, torch.bfloat16),  # Llama-2-7B, CodeLlama-7B, DeepSeek-Coder-1.3B (16)
    "tinyllama-gqa8-d64": (32, 4, 64, 16, torch.bfloat16),  # TinyLlama-1.1B
    "smollm-gqa3-d64": (9, 3, 64, 16, torch.bfloat16),  # SmolLM2-135M (and 360M: 15 / 5)
    "openllama-d100": (32, 32, 100, 16, torch.bfloat16),  # OpenLLaMA-3B: decode attention as torch ops
    "mha-d64-fp32": (8, 8, 64, 16, torch.float32),  # an odd row count per warp in fp32
    "gqa16-d80-fp16": (32, 2, 80, 16, torch.float16),
    "gqa2-d256": (8, 4, 256, 16, torch.bfloat16),
}
# GQA 9 to 15: the upper half of the tensor-core decode kernel's 16-row tile holds heads, but not
# all 8 of its rows (only the decode tests on tensor cores take it)
PARTIAL_TILE_GEOMETRIES = {"gqa12-d64": (24, 2, 64, 16, torch.bfloat16)}
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}
ACCUMULATION_FP8 = 2.0**-12  # fp8 tensor cores' sums, relative to the terms' magnitudes (test_fp8_gemm_...)


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
        num_heads, num_kv_heads, head_dim, own_block_size, dtype = {**GEOMETRIES, **PARTIAL_TILE_GEOMETRIES}[geometry]
        block_size = block_size or own_block_size
        self.dtype = dtype
        self.config = make_config(num_heads, num_kv_heads, head_dim, dtype, max_len=max_model_len)
        blocks = sum(math.ceil(n / block_size) for n in lengths) * self.config.num_layers + 64
        geo = CacheGeometry.build(self.config, dtype, block_size, num_blocks=blocks)
        num_slots = len(lengths) + spare_slots
        self.cache = KVCache(geo, num_slots, max_model_len, device=DEVICE, shuffle_seed=seed)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.cache.pool.copy_(torch.randn(self.cache.pool.shape, generator=gen, device=DEVICE, dtype=dtype))
        # slots in a scrambled order, so that sequence b is not slot b
        self.slots = random.Random(seed).sample(range(num_slots), len(lengths))
        for slot, n in zip(self.slots, lengths):
            self.cache.grow(slot, n)
        self.cache.sync_device_table()
        self.ref = TorchBackend(self.cache, self.config)
        self.cuda = CudaBackend(self.cache, self.config, fp8_weights=fp8_weights)  # (its plan's kernels only)
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
        kv = setup.cache.pool[blocks].double()  # [blocks, 2, block_size, kv_heads, D]
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


# --- (a) RoPE + K/V write --------------------------------------------------------------------

@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("width", ["vectors", "elements"])
def test_rope_write_kv_matches_reference(geometry, phase, width, monkeypatch):
    use_rope_width(monkeypatch, width)
    prompt = [1, 15, 16, 17, 100]
    s = Setup(geometry, [n + 20 for n in prompt] + [60], seed=1)
    if phase == "prefill":  # whole prompts, plus one sequence continuing a cached prefix of 20 tokens
        new = prompt + [13]
        cached = [0] * len(prompt) + [20]
        batch = StepBatch.build(True, s.slots, [[1] * n for n in new], cached, torch.device(DEVICE))
    else:
        batch = s.decode_batch([n + 20 for n in prompt] + [60])
    T = batch.token_ids.numel()
    q, k, v = s.qkv(T)
    layer = 1
    before = s.cache.pool.clone()

    s.ref.prepare(batch)
    q_ref = s.ref.rope_write_kv(layer, q, k, v, batch)
    pool_ref = s.cache.pool.clone()

    s.cache.pool.copy_(before)
    poison_allocator(q_ref.shape, dtype=s.dtype)
    s.cuda.prepare(batch)
    launched = spy_launches(s.cuda)
    q_cuda = s.cuda.rope_write_kv(layer, q, k, v, batch)
    torch.cuda.synchronize()
    assert launched == [rope_kernel(s, width)]

    assert_ulp_close(q_cuda, q_ref)
    changed = (s.cache.pool != before).flatten(2).any(-1)  # [blocks, 2]: which K/V halves we wrote
    assert changed.any()
    assert_ulp_close(s.cache.pool, pool_ref)  # the written rows, and nothing else touched
    assert torch.equal(s.cache.pool[:, 1], pool_ref[:, 1]), "V is a plain copy"
    if width == "vectors":  # the one-element kernel's arithmetic, element for element
        pool_vectors = s.cache.pool.clone()
        s.cache.pool.copy_(before)
        use_rope_width(monkeypatch, "elements")
        q_elements = s.cuda.rope_write_kv(layer, q, k, v, batch)
        torch.cuda.synchronize()
        assert torch.equal(q_cuda, q_elements) and torch.equal(pool_vectors, s.cache.pool)


# --- (b) decode attention ----------------------------------------------------------------------

def _decode_case(geometry, lengths, max_model_len, seed, layer=1, block_size=None, fp8_weights=False):
    """Decode attention of one step against float64 and the torch reference; returns the setup and
    the kernels it launched. paged_decode_mma.cu rounds P to the element type before P V (as
    paged_prefill.cu, FlashAttention and SDPA do), so it is held to the prefill kernel's bound."""
    s = Setup(geometry, lengths, max_model_len=max_model_len, seed=seed, block_size=block_size,
              fp8_weights=fp8_weights)
    batch = s.decode_batch(lengths)
    q = s.randn(len(lengths), s.config.num_heads, s.config.head_dim, scale=2.0)
    s.ref.prepare(batch)
    ref_torch = s.ref.attend(layer, q, batch)
    s.cuda.prepare(batch)
    poison_scratch(s.cuda)
    poison_allocator(q.shape, dtype=s.dtype)
    launched = spy_launches(s.cuda)
    out = s.cuda.attend(layer, q, batch)
    torch.cuda.synchronize()
    assert_decode_close(out, reference_attention_fp64(s, layer, q, lengths, s.slots), ref_torch, launched)
    return s, launched


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


def one_cta_per_kv_head(monkeypatch) -> None:
    """No split at any batch size: the decode kernel on tensor cores wherever it serves."""
    monkeypatch.setattr(cuda_launch, "SPLIT_CTAS_PER_SM", 0)


def serves_on_tensor_cores(s) -> bool:
    """Whether paged_decode_mma.cu serves this setup: built by the plan (bf16/fp16 models, sm_80+,
    within the GPU's shared memory a CTA), beside the split-KV kernel. On sm_90 (227 KiB a CTA)
    every test geometry in bf16 or fp16 has it."""
    built = s.cuda.decode_mma_shared > 0 and s.cuda.attention_kernel
    if torch.cuda.get_device_capability() >= (9, 0):
        assert built == (s.dtype != torch.float32), s.cuda.fallbacks
    return built


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_decode_attend_mixed_lengths(geometry):
    s, _ = _decode_case(geometry, list(LENGTHS), max_model_len=4200, seed=2)
    if s.cuda.cluster > 1 and geometry == "llama1b":  # sm_90+: one cluster of 8 splits per (sequence, head group)
        assert s.cuda.shapes.uses_clusters(len(LENGTHS)) and s.cuda.shapes.num_splits(len(LENGTHS)) == cuda_build.ATTN_CLUSTER


def test_decode_attend_clusters_merge_then_their_sums_merge():
    """Small batches on sm_90+: the splits of a cluster merge in shared memory, then the clusters'
    sums merge through global memory. 16 splits: a 4,097-token context (more than 8 CTAs cover with
    a chunk each) takes both clusters, a 300-token one 5 splits of 64 tokens in the first (its other
    3 CTAs have no tokens, the second cluster leaves)."""
    s, _ = _decode_case("llama1b", [4097, 300], max_model_len=8192, seed=6)
    if s.cuda.cluster > 1:
        assert s.cuda.shapes.uses_clusters(2) and s.cuda.shapes.num_splits(2) == 2 * cuda_build.ATTN_CLUSTER


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "mha-d64", "fp16", "d8-bf16-b32"])
@pytest.mark.parametrize("lengths", [LENGTHS, (4097, 300)], ids=["mixed", "two-clusters"])
def test_decode_attend_reading_the_batch_early(geometry, lengths):
    """With fp8 weights the split-KV kernels read each sequence's length, slot and first blocks
    before the programmatic-launch wait (ATTN_READ_BATCH_EARLY): the same bounds against float64,
    one cluster per (sequence, head group) or two merged, spans of several chunks."""
    s, launched = _decode_case(geometry, list(lengths), max_model_len=8192, seed=7, fp8_weights=True)
    assert launched and launched[0].startswith("paged_attention_decode") and DECODE_MMA not in launched


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "stories-fp32"])
def test_decode_attend_batch_64(geometry):
    lengths = random.Random(3).choices(LENGTHS, k=64)
    s, launched = _decode_case(geometry, lengths, max_model_len=8192, seed=3)
    if geometry == "llama1b" and s.cuda.shapes.num_splits(64) == 1:  # one CTA per (sequence, kv head)
        assert launched == [DECODE_MMA]
    elif geometry == "llama1b":  # few splits at batch 64: a 4097-token span has several chunks to merge
        assert math.ceil(4097 / s.cuda.shapes.num_splits(64)) > cuda_build.PARTITION_SIZE


@pytest.mark.parametrize("geometry", ["llama1b", "mha-d64"])
def test_decode_attend_single_long_sequence(geometry):
    _decode_case(geometry, [4097], max_model_len=4097, seed=4)


def test_decode_attend_one_split_merges_all_chunks(monkeypatch):
    """One CTA per (sequence, head group) walks every chunk and merges them (online softmax)."""
    monkeypatch.setattr(cuda_launch, "SPLIT_CTAS_PER_SM", 0)
    monkeypatch.setattr(cuda_build, "DECODE_MMA_KERNEL", False)  # paged_attention.cu's own one-split path
    s, launched = _decode_case("llama1b", [4097, 1000, 1, 513], max_model_len=8192, seed=5)
    assert s.cuda.shapes.num_splits(4) == 1 and launched == ["paged_attention_decode"]


@pytest.mark.parametrize("geometry", list(GEOMETRIES) + list(PARTIAL_TILE_GEOMETRIES))
def test_decode_attend_tensor_cores_matches_fp64_reference(geometry, monkeypatch):
    """paged_decode_mma.cu (one CTA per sequence and kv head, its warps taking 16-key tiles in
    turn): contexts of 1 key to 4,097, on both sides of a tile, a block and a round of the warps'
    tiles; every geometry our kernels serve in bf16/fp16 (GQA 1 to 16, a partly filled upper half
    of the tile among them, head_dim 8 to 256)."""
    one_cta_per_kv_head(monkeypatch)
    lengths = list(LENGTHS) + [31, 32, 33, 63, 64, 65, 129]
    s, launched = _decode_case(geometry, lengths, max_model_len=4200, seed=12)
    assert (launched == [DECODE_MMA]) == serves_on_tensor_cores(s), launched


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_decode_attend_tensor_cores_every_block_size(block_size, monkeypatch):
    one_cta_per_kv_head(monkeypatch)
    s, launched = _decode_case("llama1b", [1, 7, 8, 9, 100, 1000], max_model_len=2048, seed=13, block_size=block_size)
    assert s.cache.geometry.block_size == block_size and launched == [DECODE_MMA]


# --- (b2) prefill attention ------------------------------------------------------------------------

# (new tokens, tokens cached before them) per sequence of one prefill step
PREFILL_CASES = {
    "prompts": [(1, 0), (15, 0), (16, 0), (17, 0), (100, 0), (1000, 0), (64, 0), (65, 0)],
    "cached prefixes and decode rows": [(13, 20), (1, 64), (50, 128), (64, 64), (1, 1), (200, 37), (1, 999)],
    # as the scheduler orders a mixed step: the decoding rows first (the decode kernel's), then chunks
    "decode rows first": [(1, 64), (1, 999), (1, 0), (1, 300), (13, 20), (50, 128), (1, 37), (200, 37)],
    # too few tiles to fill the GPU: their keys split into parts (cuda_launch.key_parts), merged by the last
    "short chunks after long prefixes": [(1, 700), (60, 4000), (37, 1500)],
}


def reference_prefill_fp64(setup, layer, q, seqs, slots, rows=None):
    """Causal attention of each sequence's new tokens in float64, through the host block table.
    rows: only the last `rows` new tokens of each sequence (long prompts)."""
    geo = setup.cache.geometry
    gqa = setup.config.num_heads // setup.config.num_kv_heads
    out, start = [], 0
    for (n, cached), slot in zip(seqs, slots):
        ctx = n + cached
        blocks = torch.as_tensor(setup.cache.table[slot, layer, : math.ceil(ctx / geo.block_size)], device=DEVICE).long()
        kv = setup.cache.pool[blocks].double()
        k = kv[:, 0].reshape(-1, geo.num_kv_heads, geo.head_dim)[:ctx].repeat_interleave(gqa, dim=1)
        v = kv[:, 1].reshape(-1, geo.num_kv_heads, geo.head_dim)[:ctx].repeat_interleave(gqa, dim=1)
        first = max(0, n - rows) if rows else 0
        qb = q[start + first:start + n].double()
        s = torch.einsum("qhd,thd->hqt", qb, k) / math.sqrt(geo.head_dim)
        pos = cached + torch.arange(first, n, device=DEVICE)
        s = s.masked_fill(torch.arange(ctx, device=DEVICE)[None, None, :] > pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqt,thd->qhd", s.softmax(-1), v))
        start += n
    return torch.cat(out)


def _prefill_case(geometry, seqs, monkeypatch, block_size=None, seed=7, layer=1, cudnn=False):
    """One prefill step's attention against the torch reference; our kernels only, unless `cudnn`
    (whole long prompts may then take cudnn_prefill.py's path)."""
    lengths = [n + c for n, c in seqs]
    s = Setup(geometry, lengths, max_model_len=max(lengths) + 16, seed=seed, block_size=block_size)
    s.cuda.cudnn_prefill = s.cuda.cudnn_prefill and cudnn
    batch = StepBatch.build(True, s.slots, [[1] * n for n, _ in seqs], [c for _, c in seqs], torch.device(DEVICE))
    q = s.randn(sum(n for n, _ in seqs), s.config.num_heads, s.config.head_dim, scale=2.0)
    s.ref.prepare(batch)
    ref_torch = s.ref.attend(layer, q, batch)
    if s.cuda.prefill_kernel:
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


def assert_prefill_close(out, ref64):
    """P is rounded to the element type before P V (as FlashAttention and SDPA do): the output is
    within a few of the dtype's ulps of the float64 result, relative to the largest output."""
    bound = (2e-6 if out.dtype == torch.float32 else 8 * ULP[out.dtype]) * ref64.abs().max().item()
    worst = (out.double() - ref64).abs().max().item()
    assert worst <= bound, f"off the fp64 reference by {worst} (bound {bound})"


@pytest.mark.parametrize("geometry", [g for g, spec in GEOMETRIES.items() if spec[4] != torch.float32])
def test_whole_prompts_through_cudnn_beside_our_kernels_match_fp64(geometry, monkeypatch):
    """sm_90+: in one step, the whole prompts of CUDNN_MIN_TOKENS tokens or more take cuDNN's
    attention (cudnn_prefill.py, K/V gathered through the shuffled block table), and the rest our
    kernels: the decoding rows, chunks after cached prefixes (one as long), a short prompt. Every
    row against float64."""
    from torch.nn.attention import SDPBackend

    from pagedcli.backends import cudnn_prefill
    from pagedcli.backends.cudnn_prefill import CUDNN_MIN_TOKENS

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN's prefill path is taken on sm_90+")
    # cuDNN alone, no FlashAttention behind it: a shape it refused would fail here, not pass slower
    monkeypatch.setattr(cudnn_prefill, "_backends", lambda: [SDPBackend.CUDNN_ATTENTION])
    n = CUDNN_MIN_TOKENS
    seqs = [(1, 64), (1, 300), (n, 0), (200, 37), (n + 333, 0), (n, 5), (n - 1, 0), (17, 0)]
    s, q, out = _prefill_case(geometry, seqs, monkeypatch, cudnn=True)
    if not s.cuda.cudnn_prefill:
        assert s.cuda.head_dim % 8 or s.cuda.head_dim < 64, s.cuda.cudnn_prefill_missing  # (cuDNN's head_dims)
        pytest.skip(f"head_dim {s.cuda.head_dim}: {s.cuda.cudnn_prefill_missing}")
    assert [(b, rows) for b, _, rows in s.cuda._whole_prompts] == [(2, n), (4, n + 333)]
    assert_prefill_close(out, reference_prefill_fp64(s, 1, q, seqs, s.slots))


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attend_matches_fp64_reference(geometry, case, monkeypatch):
    seqs = PREFILL_CASES[case]
    s, q, out = _prefill_case(geometry, seqs, monkeypatch)
    assert s.cuda.prefill_kernel == (s.dtype != torch.float32), s.cuda.fallbacks
    if s.cuda.prefill_kernel and s.cuda.attention_kernel:  # the leading one-token rows went to the decode kernel
        assert s.cuda._prefill_work.decode_slots.shape[0] == {"prompts": 1, "cached prefixes and decode rows": 0,
                                                              "decode rows first": 4,
                                                              "short chunks after long prefixes": 1}[case]
    if s.cuda.prefill_kernel and case == "short chunks after long prefixes":
        assert s.cuda._prefill_work.tile_parts.max().item() > 1, "no tile's keys were split"
    assert_prefill_close(out, reference_prefill_fp64(s, 1, q, seqs, s.slots))


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_prefill_attend_every_block_size(block_size, monkeypatch):
    seqs = PREFILL_CASES["cached prefixes and decode rows"]
    s, q, out = _prefill_case("llama1b", seqs, monkeypatch, block_size=block_size)
    assert s.cache.geometry.block_size == block_size
    assert_prefill_close(out, reference_prefill_fp64(s, 1, q, seqs, s.slots))


@pytest.mark.parametrize("seqs", [[(16000, 0)], [(4000, 0), (3000, 1000), (1, 4000), (8000, 96)]])
def test_prefill_attend_long_prompts(seqs, monkeypatch):
    """16k-token prompts and long chunks after cached prefixes: the last rows against float64."""
    s, q, out = _prefill_case("llama1b", seqs, monkeypatch)
    rows = 40
    ref64 = reference_prefill_fp64(s, 1, q, seqs, s.slots, rows=rows)
    ends = torch.cumsum(torch.tensor([n for n, _ in seqs]), 0).tolist()
    picked = torch.cat([out[e - min(rows, n):e] for e, (n, _) in zip(ends, seqs)])
    assert_prefill_close(picked, ref64)


# --- (c) elementwise ---------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", ["llama1b", "stories-fp32", "fp16"])
@pytest.mark.parametrize("hidden", [2048, 64, 100, 8192])
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm(geometry, hidden, rows, monkeypatch):
    s = Setup(geometry, [16], seed=6)
    x = s.randn(rows, hidden, scale=3.0)
    weight = s.randn(hidden, scale=0.5) + 1
    ref = s.ref.rms_norm(x, weight, 1e-5)
    forbid_torch_fallback(monkeypatch, "rms_norm")
    poison_allocator((rows, hidden), dtype=s.dtype)
    out = s.cuda.rms_norm(x, weight, 1e-5)
    torch.cuda.synchronize()
    if s.dtype == torch.float32:  # an ulp of difference in the statistics shows in most outputs
        assert_ulp_close(out, ref, ulps=8.0, min_identical=0.0)
    else:
        assert_ulp_close(out, ref, ulps=2.0, min_identical=0.99)


@pytest.mark.parametrize("geometry", ["llama1b", "stories-fp32", "fp16"])
@pytest.mark.parametrize("hidden", [2048, 64, 100])
@pytest.mark.parametrize("rows", [3, 64])
def test_linear_add_norm(geometry, hidden, rows, monkeypatch):
    """Past gemv.cu's rows, the residual add and the norm after it are one kernel (add_rms_norm):
    the sum torch's add stores and our rms_norm of that sum, bit for bit (test_rms_norm holds
    rms_norm against torch's), the sum written into the residual."""
    s = Setup(geometry, [16], seed=8)
    x = s.randn(rows, hidden)
    weight = s.randn(hidden, hidden, scale=hidden**-0.5)
    residual = s.randn(rows, hidden, scale=3.0)
    norm_weight = s.randn(hidden, scale=0.5) + 1
    want_sum = s.ref.linear_add(x, weight, residual.clone())
    want_normed = s.cuda.rms_norm(want_sum, norm_weight, 1e-5)

    def fail(*args, **kwargs):
        raise AssertionError("add_norm fell back to torch ops")
    monkeypatch.setattr(composed, "add_norm", fail)
    poison_allocator((rows, hidden), dtype=s.dtype)
    got_sum, got_normed = s.cuda.linear_add_norm(x, weight, residual.clone(), norm_weight, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(got_sum, want_sum) and torch.equal(got_normed, want_normed)
    # the sum goes into the residual's memory; a bias (attention_bias, mlp_bias) is the GEMM's
    bias = s.randn(hidden)
    want_sum = s.ref.linear_add(x, weight, residual.clone(), bias)
    got_sum, got_normed = s.cuda.linear_add_norm(x, weight, residual, norm_weight, 1e-5, bias=bias)
    torch.cuda.synchronize()
    assert got_sum.data_ptr() == residual.data_ptr(), "the sum is not in the residual's memory"
    assert torch.equal(got_sum, want_sum) and torch.equal(got_normed, s.cuda.rms_norm(want_sum, norm_weight, 1e-5))


@pytest.mark.parametrize("geometry", ["llama1b", "stories-fp32", "fp16"])
@pytest.mark.parametrize("inter", [8192, 172, 5])
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_mul(geometry, inter, rows, monkeypatch):
    s = Setup(geometry, [16], seed=7)
    gate_up = s.randn(rows, 2 * inter, scale=4.0)
    ref = s.ref.silu_mul(gate_up)
    forbid_torch_fallback(monkeypatch, "silu_mul")
    poison_allocator(ref.shape, dtype=s.dtype)
    out = s.cuda.silu_mul(gate_up)
    torch.cuda.synchronize()
    if s.dtype == torch.float32:  # no rounding to hide an expf that differs by an ulp
        assert_ulp_close(out, ref, ulps=4.0, min_identical=0.5)
    else:
        assert_ulp_close(out, ref)


# --- (d) a decode step in a CUDA graph -----------------------------------------------------------

def test_decode_step_in_cuda_graph_replays_with_new_contents():
    B, layer = 8, 1
    first = [1, 15, 16, 17, 1000, 4097, 300, 64]
    later = [2, 16, 17, 18, 900, 4000, 301, 65]  # positions move, including across block borders
    s = Setup("llama1b", [4100] * B, max_model_len=4200, seed=8)  # every slot holds 4100 tokens' blocks
    c = s.config
    batch = s.decode_batch(first)
    hidden = c.hidden_size
    x = s.randn(B, hidden)
    weight = s.randn(hidden, scale=0.5) + 1
    w_qkv = s.randn(c.q_dim + 2 * c.kv_dim, hidden, scale=0.05)
    w_gate_up = s.randn(2 * c.intermediate_size, hidden, scale=0.05)
    w_down = s.randn(hidden, c.intermediate_size, scale=0.05)
    q_in, k_in, v_in = s.qkv(B)

    def step():  # what a decode layer launches: the GEMVs with their fused steps, RoPE + K/V write, attention
        be = s.cuda
        be.prepare(batch)
        qkv = be.norm_linear(x, weight, w_qkv, 1e-5)
        q = be.rope_write_kv(layer, q_in, k_in, v_in, batch)
        act = be.norm_linear_silu(x, weight, w_gate_up, 1e-5)
        return qkv, q, be.attend(layer, q, batch), be.linear_add(act, w_down, x.clone())

    side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph's docs advise
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    # new contents, same tensors: other lengths, positions and a permutation of the slots
    new_slots = list(reversed(s.slots))
    fresh = s.decode_batch(later, slots=new_slots)
    for name in ("token_ids", "positions", "token_seq", "slots", "context_lens", "last_index"):
        getattr(batch, name).copy_(getattr(fresh, name))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in captured]

    eager = step()  # the same inputs, eagerly (writes the same K/V again)
    torch.cuda.synchronize()
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)

    s.ref.prepare(fresh)
    q_ref = s.ref.rope_write_kv(layer, q_in, k_in, v_in, fresh)
    out_ref = s.ref.attend(layer, q_ref, fresh)
    assert_ulp_close(replayed[1], q_ref)
    ref64 = reference_attention_fp64(s, layer, q_ref, later, new_slots)
    assert_attention_close(replayed[2], ref64, out_ref)


# --- (e) padding rows --------------------------------------------------------------------------

@pytest.mark.parametrize("width", ["vectors", "elements"])
@pytest.mark.parametrize("attention", ["split-kv", "tensor cores"])
def test_padding_rows_write_nothing_and_stay_finite(width, attention, monkeypatch):
    use_rope_width(monkeypatch, width)
    if attention == "tensor cores":
        one_cta_per_kv_head(monkeypatch)
    layer = 0
    lengths = [100, 17, 4097, 33]
    s = Setup("llama1b", lengths, seed=9)
    padded = s.decode_batch(lengths)
    pad = [1, 3]
    padded.positions[pad] = -1
    padded.context_lens[pad] = 0
    padded.slots[pad] = s.slots[0]  # a live slot: nothing of it may be touched
    q, k, v = s.qkv(len(lengths))
    before = s.cache.pool.clone()

    s.cuda.prepare(padded)
    poison_scratch(s.cuda)
    launched = spy_launches(s.cuda)
    q_rot = s.cuda.rope_write_kv(layer, q, k, v, padded)
    assert launched == [rope_kernel(s, width)]
    poison_allocator(q_rot.shape, dtype=s.dtype)  # the zeros must be written, not found
    out = s.cuda.attend(layer, q_rot, padded)
    assert (launched[-1] == DECODE_MMA) == (attention == "tensor cores")
    torch.cuda.synchronize()
    assert torch.isfinite(q_rot).all() and torch.isfinite(out).all()
    assert not q_rot[pad].any() and not out[pad].any()  # zeros
    after_padded = s.cache.pool.clone()

    # the same step without the padding rows writes exactly the same bytes
    real = [0, 2]
    s.cache.pool.copy_(before)
    batch = s.decode_batch([lengths[i] for i in real], slots=[s.slots[i] for i in real])
    s.cuda.prepare(batch)
    q_real = s.cuda.rope_write_kv(layer, q[real], k[real], v[real], batch)
    out_real = s.cuda.attend(layer, q_real, batch)
    torch.cuda.synchronize()
    assert torch.equal(s.cache.pool, after_padded)
    assert torch.equal(q_rot[real], q_real)
    torch.testing.assert_close(out[real].float(), out_real.float(), rtol=2.0**-7, atol=1e-3)


# --- (f) GEMV with its neighbours fused (small decode batches) -------------------------------------

GEMV_OPS = ("norm_linear", "logits", "norm_linear_silu", "linear_add")


def gemv_reference(s, op, x, weight, norm_weight):
    """fp64 product of the input as the reference backend stages it (same roundings), and the bound
    on fp32 accumulation error."""
    staged = s.ref.rms_norm(x, norm_weight, 1e-5) if op != "linear_add" else x
    exact = staged.double() @ weight.double().T
    slack = weight.shape[1] * 2.0**-24 * (staged.double().abs() @ weight.double().abs().T)
    return exact, slack


@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "stories-fp32"])
@pytest.mark.parametrize("op", GEMV_OPS)
@pytest.mark.parametrize("rows", [1, 2])
# (N, K): qkv's; K past a whole tile; more rows than the GPU's warps take at once (as the LM
# head's); tiny
@pytest.mark.parametrize("shape", [(3072, 2048), (1002, 2056), (20000, 256), (64, 8)])
def test_gemv_matches_fp64_reference(geometry, op, rows, shape, monkeypatch):
    check_gemv(geometry, op, rows, shape, monkeypatch)


@pytest.mark.parametrize("op", GEMV_OPS)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("split", [2, 4])
def test_gemv_split_k_matches_fp64_reference(op, rows, split, monkeypatch):
    """Warps sharing a row, each over a slice of K (the o and down projections' case, forced here on
    a shape that would not need it): K of 8 or 4 tiles, one per warp at split 4 with K 4096, and
    1026 rows, so that the last CTA has warp groups without a row (they must skip the barrier
    together)."""
    monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)
    check_gemv("llama1b", op, rows, (1026, 8192 if rows == 1 else 4096), monkeypatch)


def check_gemv(geometry, op, rows, shape, monkeypatch):
    N, K = shape
    s = Setup(geometry, [16], seed=10)
    if rows * K * s.dtype.itemsize > cuda_build.GEMV_MAX_SHARED:
        pytest.skip("past gemv.cu's staging limit: cuBLAS (test_gemv_falls_back_past_its_limits)")
    x = s.randn(rows, K, scale=2.0)
    weight = s.randn(N, K, scale=K**-0.5)
    norm_weight = s.randn(K, scale=0.5) + 1
    # the residual is a slice of a larger buffer: the rows past it must stay untouched
    buffer = s.randn(rows + 2, N)
    residual = buffer[:rows]
    guard = buffer[rows:].clone()
    exact, slack = gemv_reference(s, op, x, weight, norm_weight)
    before = residual.clone()

    forbid_torch_fallback(monkeypatch, op)
    if op == "norm_linear_silu":
        same_split_k_as_fused(monkeypatch, s, weight)
    method = getattr(s.cuda, op)
    out = method(x, weight, residual) if op == "linear_add" else method(x, norm_weight, weight, 1e-5)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()

    if op == "norm_linear_silu":
        # gate and up are summed exactly as norm_linear sums them (checked against fp64 by its own
        # cases), so the fused activation must be the reference silu_mul of norm_linear's output
        expected = s.ref.silu_mul(s.cuda.norm_linear(x, norm_weight, weight, 1e-5))
        if s.dtype == torch.float32:  # no rounding to hide an expf that differs by an ulp
            assert_ulp_close(out, expected, ulps=4.0, min_identical=0.5)
        else:
            assert_ulp_close(out, expected)
        return
    if op == "logits":
        assert out.dtype == torch.float32
        out = out.to(s.dtype)  # the logits are the dtype's product, stored as float: exact
    if op == "linear_add":
        assert out.data_ptr() == residual.data_ptr()  # in place, as the layer expects
        assert torch.equal(buffer[rows:], guard)
        product = out.double() - before.double()  # what was added (both sides rounded)
        rounding = ULP[s.dtype] * (before.double().abs() + exact.abs())
    else:
        product = out.double()
        rounding = ULP[s.dtype] * exact.abs()
    excess = ((product - exact).abs() - rounding - slack).max().item()
    assert excess <= 0, f"{op}: off the fp64 product by {excess} beyond an ulp plus accumulation error"
    if op != "linear_add" and s.dtype != torch.float32:  # fp32 has no rounding to agree on
        identical = (out == exact.to(s.dtype)).float().mean().item()
        assert identical >= 0.9, f"only {identical:.1%} identical to the rounded fp64 product"


def same_split_k_as_fused(monkeypatch, s, weight):
    """A fused kernel that pairs rows (silu-mul, RoPE) has half as many units of work as the plain
    one on the same weight, so it may split K over more warps, and sum in another order. Where a
    test asks for the plain kernel's exact sums, both use the fused kernel's split."""
    split = s.cuda.shapes.gemv_split(weight.shape[0] // 2, weight.shape[1], weight.element_size())
    monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)


@pytest.mark.parametrize("geometry", ["llama1b", "fp16"])
@pytest.mark.parametrize("op", ["rms_norm_store", "rms_norm_float", "rms_norm_silu_mul", "plain_add"])
@pytest.mark.parametrize("rows", [1, 2])
# qkv's (split K at batch 1); K past a whole tile of 2,048 fp8 weights; many rows; one 16-byte load
@pytest.mark.parametrize("shape", [(3072, 2048), (1040, 2064), (20000, 256), (64, 16)])
def test_gemv_fp8_weights_match_fp64_reference(geometry, op, rows, shape):
    """gemv8_ (fp8 weights, `--quantization fp8`): the fp32 sum of x times the e4m3 values, times the
    row's scale (model/fp8.py's fp8_linear), within an ulp of the fp64 product of the same staged
    input and dequantized weight plus fp32 accumulation error; silu-mul is silu_mul of its own
    store output (the same sums)."""
    from pagedcli.model.fp8 import quantize_weight

    N, K = shape
    s = Setup(geometry, [16], seed=13)
    x = s.randn(rows, K, scale=2.0)
    weight = quantize_weight(s.randn(N, K, scale=K**-0.5))
    norm_weight = s.randn(K, scale=0.5) + 1
    residual = s.randn(rows, N)
    before = residual.clone()
    staged = s.ref.rms_norm(x, norm_weight, 1e-5) if op != "plain_add" else x
    dequantized = weight.dequantize(torch.float64)
    exact = staged.double() @ dequantized.T
    slack = K * 2.0**-24 * (staged.double().abs() @ dequantized.abs().T)
    out = gemv(s.cuda, op, x, weight, norm_weight, 1e-5, residual=residual)
    assert out is not None, "gemv.cu's fp8 kernel did not take the shape"
    torch.cuda.synchronize()
    if op == "rms_norm_float":  # the LM head's: the dtype's rounded product, stored as float
        assert out.dtype == torch.float32 and torch.equal(out, out.to(s.dtype).float())
    if op == "rms_norm_silu_mul":
        split = s.cuda.shapes.gemv_split(N // 2, K, 1)  # the store below sums as the fused kernel did
        s.cuda.shapes.gemv_split = lambda units, K, *_: split
        expected = s.ref.silu_mul(gemv(s.cuda, "rms_norm_store", x, weight, norm_weight, 1e-5))
        assert_ulp_close(out, expected)
        return
    if op == "plain_add":
        product, rounding = out.double() - before.double(), ULP[s.dtype] * (before.double().abs() + exact.abs())
    else:
        product, rounding = out.double(), ULP[s.dtype] * exact.abs()
    excess = ((product - exact).abs() - rounding - slack).max().item()
    assert excess <= 0, f"{op}: off the fp64 product by {excess} beyond an ulp plus accumulation error"


def fp8_backend(s: Setup):
    """The CUDA backend over s's cache with fp8 weights (their W8A8 GEMMs compiled in)."""
    be = CudaBackend(s.cache, s.config, fp8_weights=True)
    if not be.fp8_gemm:
        pytest.skip(f"no fp8 GEMMs here: {be.fallbacks.get('linear layers')}")
    return be


@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "mha-d64-fp32"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "rms_norm"])
# a vector path and the scalar one (2,050 columns: rows not whole 16-byte vectors), a long row
@pytest.mark.parametrize("K", [2048, 2050, 8192, 64])
def test_fp8_activation_quantization_is_the_references_bytes(geometry, norm, K):
    """fp8_quant.cu (`--quantization fp8` over W8A16_MAX_ROWS rows): per row, scale = amax / 448
    and e4m3(y / scale), byte for byte model/fp8.py's quantize_rows of the torch RMSNorm (or of x);
    a row of zeros gets scale 1, a row of one huge value keeps it at 448."""
    from pagedcli.backends.cuda_fp8_gemm import quantize_rows as kernel_quantize
    from pagedcli.model.fp8 import quantize_rows, raw

    s = Setup(geometry, [16], seed=21)
    be = fp8_backend(s)
    x = s.randn(37, K, scale=3.0)
    x[5] = 0
    x[7, :] = 0
    x[7, 3] = -6e4 if s.dtype == torch.float16 else 1e30 if s.dtype == torch.float32 else 3e38
    norm_weight = s.randn(K, scale=0.5) + 1
    # in float32 no rounding hides the order of the sum of squares: there the reference for the norm
    # is elementwise.cu's (the same sums; its own tests hold it to torch's)
    rms_norm = s.cuda.rms_norm if s.dtype == torch.float32 else s.ref.rms_norm
    y = rms_norm(x, norm_weight, 1e-5) if norm else x
    want_values, want_scales = quantize_rows(y)
    values, scales = kernel_quantize(be, x, norm_weight if norm else None, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(scales, want_scales), "the rows' scales differ"
    assert torch.equal(raw(values), raw(want_values)), "the e4m3 bytes differ"
    assert scales[5].item() == 1.0 and (values[5].float() == 0).all()  # (-0 where the norm's weight is negative)
    if not norm:
        assert values[7, 3].float().item() == (-448.0 if s.dtype == torch.float16 else 448.0)


@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "mha-d64-fp32"])
@pytest.mark.parametrize("rows", [3, 64, 300])
@pytest.mark.parametrize("shape", [(3072, 2048), (2048, 8192), (1040, 2064)])
def test_fp8_gemm_matches_fp64_of_its_quantized_operands(geometry, rows, shape):
    """cuda_fp8_gemm.fp8_gemm (W8A8): torch._scaled_mm of the quantized rows and the e4m3 weights,
    both scales applied, within an ulp of the model dtype plus the fp8 tensor cores' accumulation
    error of the fp64 product of the same operands; and the backend's layer steps take it over 2
    rows, as close to the torch reference's W8A8 ops. (Hopper's fp8 MMA keeps about 14 bits of its
    running sums within a K block, which CUTLASS then adds in fp32: errors near 2^-13 of the sum of
    the terms' magnitudes, far above fp32's, far below a wrong scale's or layout's.)"""
    from pagedcli.backends.cuda_fp8_gemm import fp8_gemm, quantize_rows as kernel_quantize
    from pagedcli.model.fp8 import quantize_weight

    N, K = shape
    s = Setup(geometry, [16], seed=23)
    be = fp8_backend(s)
    x = s.randn(rows, K, scale=2.0)
    weight = quantize_weight(s.randn(N, K, scale=K**-0.5))
    norm_weight = s.randn(K, scale=0.5) + 1
    for norm in (None, norm_weight):
        out = fp8_gemm(be, x, weight, norm, 1e-5)
        assert out is not None and out.dtype == s.dtype, "the W8A8 GEMM did not take the shape"
        values, scales = kernel_quantize(be, x, norm, 1e-5)
        exact = (values.double() @ weight.values.double().T) * scales.double() * weight.scale.double()
        size = (values.double().abs() @ weight.values.double().abs().T) * scales.double() * weight.scale.double()
        slack = ACCUMULATION_FP8 * size
        excess = ((out.double() - exact).abs() - ULP[s.dtype] * exact.abs() - slack).max().item()
        assert excess <= 0, f"off the fp64 W8A8 product by {excess} beyond an ulp plus accumulation error"
    # rows normed beforehand (linear_add_norm's `normed`: our rms_norm's) quantize to the bytes the
    # norm fused into the quantization gives, so the GEMM is the same either way
    prenormed = kernel_quantize(be, be.rms_norm(x, norm_weight, 1e-5))
    fused = kernel_quantize(be, x, norm_weight, 1e-5)
    assert torch.equal(prenormed[0].view(torch.uint8), fused[0].view(torch.uint8))
    assert torch.equal(prenormed[1], fused[1])
    # the layer steps over W8A16_MAX_ROWS rows: W8A8, as the torch reference computes it (the same
    # bytes in: the test above), apart by the accumulation error and a rounding or two
    residual = s.randn(rows, N)
    magnitude = weight.dequantize(torch.float64).abs().T
    normed = s.ref.rms_norm(x, norm_weight, 1e-5)
    for got, want, rows_in in ((be.linear_add(x, weight, residual.clone()), s.ref.linear_add(x, weight, residual.clone()), x),
                               (be.norm_linear(x, norm_weight, weight, 1e-5), s.ref.norm_linear(x, norm_weight, weight, 1e-5),
                                normed)):
        bound = 2 * ACCUMULATION_FP8 * (rows_in.double().abs() @ magnitude) \
            + 2 * ULP[s.dtype] * (want.double().abs() + residual.double().abs())
        assert ((got.double() - want.double()).abs() <= bound).all(), "a layer step is off the reference's W8A8"
    # an fp8 LM head over W8A16_MAX_ROWS rows: the same W8A8 GEMM, its float logits the dtype's product
    got, want = be.logits(x, norm_weight, weight, 1e-5), s.ref.logits(x, norm_weight, weight, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(got, got.to(s.dtype).float())
    bound = 2 * ACCUMULATION_FP8 * (normed.double().abs() @ magnitude) + 2 * ULP[s.dtype] * want.double().abs()
    assert ((got.double() - want.double()).abs() <= bound).all(), "the LM head is off the reference's W8A8"


def test_gemv_falls_back_past_its_limits():
    s = Setup("llama1b", [16], seed=11)
    weight = s.randn(256, 2048)
    norm_weight = s.randn(2048) + 1
    many_rows = s.randn(cuda_build.GEMV_MAX_ROWS + 1, 2048)
    assert gemv(s.cuda, "rms_norm_store", many_rows, weight, norm_weight, 1e-5) is None
    ref = s.ref.norm_linear(many_rows, norm_weight, weight, 1e-5)
    torch.testing.assert_close(s.cuda.norm_linear(many_rows, norm_weight, weight, 1e-5), ref, rtol=2**-7, atol=1e-2)
    odd = s.randn(1, 2049)[:, 1:]  # a row that is not 16-byte aligned
    assert gemv(s.cuda, "rms_norm_store", odd, weight, norm_weight, 1e-5) is None


# --- (g) greedy argmax -----------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [128256, 4097, 5])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_argmax_matches_torch_including_ties(vocab, rows, monkeypatch):
    s = Setup("llama1b", [16], seed=13)
    logits = torch.randn(rows, vocab, generator=s.gen, device=DEVICE) - 5.0  # mostly negative
    if vocab > 4:
        logits[0, vocab - 1] = logits[0, 1] = 50.0  # a tie in different CTAs' chunks: the first wins
        logits[-1, :] = -1.0  # all equal: index 0
    forbid_torch_fallback(monkeypatch, "argmax")
    for _ in range(2):  # the second launch finds its keys and counters reset
        assert torch.equal(s.cuda.argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -float("nan")])
def test_argmax_marks_rows_that_are_not_finite(bad, monkeypatch):
    """A NaN or an inf anywhere in a row (here in the last CTA's chunk, and in the first) makes its
    token NOT_FINITE, as the torch reference says; the other rows keep theirs, and the next launch
    (counters and flags reset) is clean again."""
    from pagedcli.backends import NOT_FINITE

    s = Setup("llama1b", [16], seed=15)
    logits = torch.randn(4, 128256, generator=s.gen, device=DEVICE)
    poisoned = logits.clone()
    poisoned[1, -3] = bad
    poisoned[3, 5] = bad
    forbid_torch_fallback(monkeypatch, "argmax")
    tokens = s.cuda.argmax(poisoned)
    expected = logits.argmax(dim=-1)
    expected[1] = expected[3] = NOT_FINITE
    assert torch.equal(tokens, expected)
    assert torch.equal(s.cuda.argmax(logits), logits.argmax(dim=-1))
    monkeypatch.undo()
    assert torch.equal(s.ref.argmax(poisoned), expected)


@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "stories-fp32"])
@pytest.mark.parametrize("vocab", [128256, 4101])  # whole 16-byte vectors of a row, and not
@pytest.mark.parametrize("rows", [3, 64])
def test_logits_greedy_widens_the_lm_head_product_as_it_takes_the_argmax(geometry, vocab, rows, monkeypatch):
    """Past gemv.cu's rows the LM head's product is in the model dtype: argmax_rows_widen writes it
    as float32 (exactly the product's values) with the argmax of each row, ties to the first, a row
    holding a NaN or an inf marked NOT_FINITE, and the next launch clean again."""
    from pagedcli.backends import NOT_FINITE

    s = Setup(geometry, [16], seed=17)
    hidden = 256
    x, norm_weight = s.randn(rows, hidden), s.randn(hidden, scale=0.5) + 1
    lm_head = s.randn(vocab, hidden, scale=hidden**-0.5)
    # row 0's largest logit twice, in the first and the last CTA's chunks: the first index wins
    lm_head[1] = lm_head[vocab - 1] = s.cuda.rms_norm(x[:1], norm_weight, 1e-5)[0]
    forbid_torch_fallback(monkeypatch, "argmax")
    for _ in range(2):  # the second launch finds its keys and counters reset
        logits, tokens = s.cuda.logits_greedy(x, norm_weight, lm_head, 1e-5)
        product = s.cuda.rms_norm(x, norm_weight, 1e-5) @ lm_head.T
        assert logits.dtype == torch.float32 and torch.equal(logits, product.float())
        assert torch.equal(tokens, logits.argmax(dim=-1))
        if logits[0, 1] == logits[0, vocab - 1]:  # (equal rows, equal sums: as cuBLAS gave them on the H200)
            assert tokens[0] == 1
    monkeypatch.undo()
    poisoned = x.clone()
    poisoned[1, 7] = float("nan")
    logits, tokens = s.cuda.logits_greedy(poisoned, norm_weight, lm_head, 1e-5)
    assert tokens[1] == NOT_FINITE and torch.equal(tokens[2:], logits[2:].argmax(dim=-1))


# --- (h) the qkv GEMV with RoPE and the K/V write fused -------------------------------------------

@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "stories-fp32"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_fused_attention_inputs_equal_gemv_then_kv_write(geometry, phase, monkeypatch):
    """The fused kernel's q and pool bytes are those of norm_linear followed by kv_write.cu: the
    same sums, rounded the same way, written to the same rows (padding rows write nothing)."""
    lengths = [40, 300]  # gemv.cu takes at most GEMV_MAX_ROWS (2) rows
    s = Setup(geometry, lengths, seed=14)
    c, layer = s.config, 1
    if phase == "decode":
        batch = s.decode_batch(lengths)
        batch.positions[1], batch.context_lens[1] = -1, 0  # a padding row
    else:  # a small prefill: the last 2 tokens of a sequence
        batch = StepBatch.build(True, s.slots[:1], [[5, 6]], [38], torch.device(DEVICE))
    T = batch.token_ids.shape[0]
    x = s.randn(T, c.hidden_size, scale=2.0)
    qkv = s.randn(c.q_dim + 2 * c.kv_dim, c.hidden_size, scale=c.hidden_size**-0.5)
    norm_weight = s.randn(c.hidden_size) + 1
    pool0 = s.cache.pool.clone()

    s.cuda.prepare(batch)
    same_split_k_as_fused(monkeypatch, s, qkv)
    q, k, v = s.cuda.norm_linear(x, norm_weight, qkv, 1e-5).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q_ref = s.cuda.rope_write_kv(layer, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                                 v.view(T, c.num_kv_heads, c.head_dim), batch)
    torch.cuda.synchronize()
    pool_ref = s.cache.pool.clone()
    assert not torch.equal(pool_ref, pool0)  # the step wrote K/V

    s.cache.pool.copy_(pool0)
    forbid_torch_fallback(monkeypatch, "attention_inputs")
    q_fused = s.cuda.attention_inputs(layer, x, norm_weight, qkv, 1e-5, batch)
    torch.cuda.synchronize()
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(s.cache.pool, pool_ref)
