"""Decode attention of the CUDA backend against float64 and the torch reference backend, on the same
cache, on a GPU: the split-KV kernel (mixed lengths, clusters merged on sm_90+, one split, batch 64,
the batch read early with fp8 weights) and the tensor-core kernel (paged_decode_mma.cu) in every
test geometry and block size; a decode step captured in a CUDA graph and replayed with new contents;
padding rows, which write nothing and stay finite; a sliding window (WindowSetup: the blocks behind
it given back and filled with NaN) through every decode kernel, in the model dtype and an fp8 pool.
How the caches are set up, and the tolerances: cuda_checks.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cuda_checks import (DECODE_MMA, DEVICE, GEOMETRIES, LENGTHS, PARTIAL_TILE_GEOMETRIES, Setup,
                         assert_attention_close, assert_decode_close, assert_ulp_close, make_config, poison_allocator,
                         poison_scratch, reference_attention_fp64)
from helpers import rope_kernel, spy_launches, use_rope_width
from pagedcli.backends.cuda import cuda_available

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    import pagedcli.backends.cuda_build as cuda_build
    import pagedcli.backends.cuda_launch as cuda_launch


# --- decode attention -----------------------------------------------------------------------------

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


# --- a decode step in a CUDA graph ----------------------------------------------------------------

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


# --- padding rows ---------------------------------------------------------------------------------

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
    before = s.cache.store.pool.clone()

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
    after_padded = s.cache.store.pool.clone()

    # the same step without the padding rows writes exactly the same bytes
    real = [0, 2]
    s.cache.store.pool.copy_(before)
    batch = s.decode_batch([lengths[i] for i in real], slots=[s.slots[i] for i in real])
    s.cuda.prepare(batch)
    q_real = s.cuda.rope_write_kv(layer, q[real], k[real], v[real], batch)
    out_real = s.cuda.attend(layer, q_real, batch)
    torch.cuda.synchronize()
    assert torch.equal(s.cache.store.pool, after_padded)
    assert torch.equal(q_rot[real], q_real)
    torch.testing.assert_close(out[real].float(), out_real.float(), rtol=2.0**-7, atol=1e-3)


# --- a sliding window -----------------------------------------------------------------------------

class WindowSetup:
    """A cache with a sliding window of `window` tokens: sequences of `lengths` tokens in shuffled
    blocks (scrambled slots), each given back its blocks behind the window as KVCache.slide does
    after the step that cached `cached[b]` of them (the next query is at position cached[b]), and
    those blocks filled with NaN: a kernel that reads one, even to multiply it by zero, fails. A pool
    in the model dtype, or with `fp8` an e4m3 pool with per-layer-and-head scales (as
    test_gpu_fp8_kv.py's). Both backends over it; `cuda=False` builds the torch reference alone
    (the CPU checks of this setup and of window_reference_fp64)."""

    def __init__(self, geometry, lengths, cached, window, seed=0, block_size=None, fp8=False, device=DEVICE,
                 max_model_len=8192, cuda=True):
        from pagedcli.backends.torch import TorchBackend
        from pagedcli.core.fp8 import FP8_DTYPE, KVScales, raw, to_fp8
        from pagedcli.core.geometry import CacheGeometry
        from pagedcli.engine.cache import KVCache

        g = {**GEOMETRIES, **PARTIAL_TILE_GEOMETRIES}[geometry]
        block_size = block_size or g.block_size
        self.dtype, self.window, self.fp8, self.device = g.dtype, window, fp8, device
        self.config = replace(make_config(g.num_heads, g.num_kv_heads, g.head_dim, g.dtype, max_len=max_model_len),
                              architecture="MistralForCausalLM", sliding_window=window)
        layers = self.config.num_layers
        blocks = sum(math.ceil(n / block_size) for n in lengths) * layers + 64
        geo = CacheGeometry.build(self.config, g.dtype, block_size, num_blocks=blocks,
                                  cache_dtype=FP8_DTYPE if fp8 else None)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        scales = None
        if fp8:
            scales = KVScales(*(torch.rand((layers, g.num_kv_heads), generator=self.gen, device=device) * 0.1 + 0.02
                                for _ in "kv"))
        self.cache = KVCache(geo, len(lengths), max_model_len, device=device, shuffle_seed=seed, kv_scales=scales,
                             sliding_window=window)
        pool = self.cache.store.pool
        values = torch.randn(pool.shape, generator=self.gen, device=device)
        if fp8:
            raw(pool).copy_(raw(to_fp8(values * 16)))
        else:
            pool.copy_(values.to(g.dtype))
        self.slots = random.Random(seed).sample(range(len(lengths)), len(lengths))
        for slot, n in zip(self.slots, lengths):
            self.cache.grow(slot, n)
        held = self.cache.table.copy()
        self.cache.slide([SimpleNamespace(slot=slot, num_cached=c) for slot, c in zip(self.slots, cached)])
        self.freed = torch.as_tensor(held[(held >= 0) & (self.cache.table < 0)], dtype=torch.long, device=device)
        if fp8:
            raw(pool)[self.freed] = 0x7F  # e4m3's NaN
        else:
            pool[self.freed] = float("nan")
        self.cache.sync_device_table()
        self.ref = TorchBackend(self.cache.store, self.config)
        self.cuda = None
        if cuda:
            from pagedcli.backends.cuda import CudaBackend

            self.cuda = CudaBackend(self.cache.store, self.config)
            attention = {"decode attention", "prefill attention"} if g.dtype != torch.float32 else {"decode attention"}
            assert not attention & self.cuda.fallbacks.keys(), self.cuda.fallbacks  # the window is the kernels'

    def randn(self, *shape, scale=1.0):
        x = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return x.mul_(scale).to(self.dtype)

    def kv64(self, layer: int, slot: int, first: int, stop: int):
        """Keys and values first .. stop - 1 of a sequence in float64 (an fp8 pool's dequantized),
        read through the host table from first's block on (never a block given back), repeated for
        GQA: [stop - first, heads, head_dim] each."""
        from pagedcli.core.fp8 import FP8_DTYPE, raw

        geo = self.cache.geometry
        gqa = self.config.num_heads // geo.num_kv_heads
        b0, b1 = first // geo.block_size, math.ceil(stop / geo.block_size)
        at = b0 * geo.block_size  # the first block's first position
        blocks = torch.as_tensor(self.cache.table[slot, layer, b0:b1], device=self.device).long()
        assert (blocks >= 0).all(), "a key in the window sits in a block given back"
        pool = raw(self.cache.store.pool)[blocks].view(FP8_DTYPE) if self.fp8 else self.cache.store.pool[blocks]
        kv = pool.double()  # [blocks, 2, block_size, kv_heads, D]
        out = []
        for i in range(2):
            x = kv[:, i].reshape(-1, geo.num_kv_heads, geo.head_dim)[first - at:stop - at]
            if self.fp8:
                scale = (self.cache.store.kv_scales.k, self.cache.store.kv_scales.v)[i][layer]
                x = x * scale.double()[None, :, None]
            out.append(x.repeat_interleave(gqa, dim=1))
        return out


def window_reference_fp64(setup: WindowSetup, layer, q, seqs, slots, rows=None):
    """Attention of each sequence's new tokens (seqs: (new, cached) each) in float64 under the
    sliding window: the row at position p sees keys max(p - W + 1, 0) .. p. rows: only the last
    `rows` new tokens of each sequence. [T or rows per sequence, heads, head_dim]."""
    W, out, start = setup.window, [], 0
    for (n, cached), slot in zip(seqs, slots):
        first = max(0, n - rows) if rows else 0
        pos = torch.arange(cached + first, cached + n, device=setup.device)
        low = max(cached + first - W + 1, 0)
        k, v = setup.kv64(layer, slot, low, cached + n)
        key = torch.arange(low, cached + n, device=setup.device)
        s = torch.einsum("qhd,thd->hqt", q[start + first:start + n].double(), k) / math.sqrt(setup.config.head_dim)
        seen = (key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - W)
        s = s.masked_fill(~seen[None], float("-inf"))
        out.append(torch.einsum("hqt,thd->qhd", s.softmax(-1), v))
        start += n
    return torch.cat(out)


def window_decode_case(geometry, lengths, window, seed=21, block_size=None, fp8=False, layer=1):
    """One decode step under a window (each sequence's last token the query), the blocks behind
    the window given back and poisoned, against float64 and the torch reference; returns the setup
    and the kernels launched."""
    s = WindowSetup(geometry, lengths, [n - 1 for n in lengths], window, seed=seed, block_size=block_size, fp8=fp8)
    from pagedcli.core.batch import StepBatch

    batch = StepBatch.build(False, s.slots, [[1]] * len(lengths), [n - 1 for n in lengths], torch.device(DEVICE))
    q = s.randn(len(lengths), s.config.num_heads, s.config.head_dim, scale=2.0)
    s.ref.prepare(batch)
    ref_torch = s.ref.attend(layer, q, batch)
    s.cuda.prepare(batch)
    poison_scratch(s.cuda)
    poison_allocator(q.shape, dtype=s.dtype)
    launched = spy_launches(s.cuda)
    out = s.cuda.attend(layer, q, batch)
    torch.cuda.synchronize()
    assert launched and launched[0].startswith("paged_attention_decode"), launched  # no torch fallback
    ref64 = window_reference_fp64(s, layer, q, [(1, n - 1) for n in lengths], s.slots)
    assert_decode_close(out, ref64, ref_torch, launched)
    return s, launched


# contexts around a window of 40 (not a multiple of 16): within it, at it, one past, a block past,
# far past (blocks given back), and a long one
WINDOW_LENGTHS = (1, 15, 39, 40, 41, 57, 100, 1000, 4097)


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "mha-d64", "stories-fp32", "fp16", "gqa2-d256"])
@pytest.mark.parametrize("window", [40, 1, 4096])
def test_decode_attend_a_sliding_window(geometry, window):
    """The split-KV kernels (in clusters on sm_90+ at this batch) read only each sequence's window,
    never a block given back behind it: a window of 40, of 1 (the token alone), and Mistral's
    4,096 (larger than most contexts here, crossed by the last)."""
    s, launched = window_decode_case(geometry, WINDOW_LENGTHS, window)
    assert window == 4096 or s.freed.numel() > 0, "no block was given back: the case tests nothing"
    assert launched != [DECODE_MMA]


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "mha-d64", "fp16", "gqa2-d256", "gqa12-d64"])
@pytest.mark.parametrize("block_size", [None, 8])
def test_decode_attend_a_sliding_window_on_tensor_cores(geometry, block_size, monkeypatch):
    """paged_decode_mma.cu under a window of 40: its key tiles start at the tile holding the
    window's first key, which at blocks of 8 may start in a block given back (copied as zeros,
    masked)."""
    one_cta_per_kv_head(monkeypatch)
    s, launched = window_decode_case(geometry, WINDOW_LENGTHS, 40, block_size=block_size)
    assert launched == [DECODE_MMA] and s.freed.numel() > 0


@pytest.mark.parametrize("window", [40, 700])
def test_decode_attend_a_sliding_window_in_one_split(window, monkeypatch):
    """paged_attention.cu's own one-split path (no split, no tensor cores): one CTA walks the
    window's chunks from its first block, the first chunk's tokens before the window unscored."""
    monkeypatch.setattr(cuda_launch, "SPLIT_CTAS_PER_SM", 0)
    monkeypatch.setattr(cuda_build, "DECODE_MMA_KERNEL", False)
    s, launched = window_decode_case("llama1b", WINDOW_LENGTHS, window)
    assert s.cuda.shapes.num_splits(len(WINDOW_LENGTHS)) == 1 and launched == ["paged_attention_decode"]


def test_decode_splits_are_bounded_by_the_window():
    """A context of 8,000 under a window of 600: the splits cut the window's 600 to 615 keys, so
    no more splits than those have chunks (or one cluster's CTAs), not the 8,192-token cache's 16,
    and batch 64 (few splits each) reads them right."""
    s, _ = window_decode_case("llama1b", [8000, 700, 601, 600, 599, 5] * 3, 600)
    keys = 600 + s.cache.geometry.block_size - 1
    assert s.cuda.shapes.num_splits(1) <= max(math.ceil(keys / cuda_build.PARTITION_SIZE), s.cuda.cluster)
    lengths = random.Random(4).choices([8000, 700, 601, 600, 599, 5, 1], k=64)
    window_decode_case("llama1b", lengths, 600, seed=22)


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32"])
@pytest.mark.parametrize("kernel", ["split-kv", "tensor cores"])
def test_decode_attend_a_sliding_window_over_an_fp8_pool(geometry, kernel, monkeypatch):
    """An e4m3 pool with per-head scales, the blocks behind a window of 40 given back (NaN bytes):
    both decode kernels dequantize only the window's keys."""
    if kernel == "tensor cores":
        one_cta_per_kv_head(monkeypatch)
    s, launched = window_decode_case(geometry, WINDOW_LENGTHS, 40, fp8=True, block_size=8)
    assert (launched == [DECODE_MMA]) == (kernel == "tensor cores") and s.freed.numel() > 0
