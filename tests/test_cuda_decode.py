"""Decode attention of the CUDA backend against float64 and the torch reference backend, on the same
cache, on a GPU: the split-KV kernel (mixed lengths, clusters merged on sm_90+, one split, batch 64,
the batch read early with fp8 weights) and the tensor-core kernel (paged_decode_mma.cu) in every
test geometry and block size; a decode step captured in a CUDA graph and replayed with new contents;
padding rows, which write nothing and stay finite. How the caches are set up, and the tolerances:
cuda_checks.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cuda_checks import (DECODE_MMA, GEOMETRIES, LENGTHS, PARTIAL_TILE_GEOMETRIES, Setup, assert_attention_close,
                         assert_decode_close, assert_ulp_close, poison_allocator, poison_scratch,
                         reference_attention_fp64)
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
