"""Prefill attention of the CUDA backend (paged_prefill.cu, and cuDNN's for whole long prompts on
sm_90+) against float64 and the torch reference backend, on the same cache, on a GPU: whole prompts,
chunks after cached prefixes, decode rows first, short chunks after long prefixes whose keys split
into parts, every block size, 16k-token prompts; a sliding window (test_cuda_decode.WindowSetup: the
blocks behind it given back and filled with NaN) across chunks, split keys and an fp8 pool, never
through cuDNN. How the caches are set up, and the tolerances: cuda_checks.py."""

from __future__ import annotations

import math

import pytest
import torch

from cuda_checks import (DEVICE, GEOMETRIES, PREFILL_CASES, Setup, assert_prefill_close, assert_prefill_counters_reset,
                         forbid_torch_fallback, poison_allocator, poison_scratch)
from pagedcli.backends.cuda import cuda_available

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    from pagedcli.core.batch import StepBatch


# --- prefill attention ----------------------------------------------------------------------------

def reference_prefill_fp64(setup, layer, q, seqs, slots, rows=None):
    """Causal attention of each sequence's new tokens in float64, through the host block table.
    rows: only the last `rows` new tokens of each sequence (long prompts)."""
    geo = setup.cache.geometry
    gqa = setup.config.num_heads // setup.config.num_kv_heads
    out, start = [], 0
    for (n, cached), slot in zip(seqs, slots):
        ctx = n + cached
        blocks = torch.as_tensor(setup.cache.table[slot, layer, : math.ceil(ctx / geo.block_size)], device=DEVICE).long()
        kv = setup.cache.store.pool[blocks].double()
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


@pytest.mark.parametrize("geometry", [g for g, spec in GEOMETRIES.items() if spec.dtype != torch.float32])
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


@pytest.mark.parametrize("seqs", [[(16000, 0)], [(4000, 0), (3000, 1000), (1, 4000), (8000, 96)]],
                         ids=["one-16k-prompt", "long-chunks-after-prefixes"])
def test_prefill_attend_long_prompts(seqs, monkeypatch):
    """16k-token prompts and long chunks after cached prefixes: the last rows against float64."""
    s, q, out = _prefill_case("llama1b", seqs, monkeypatch)
    rows = 40
    ref64 = reference_prefill_fp64(s, 1, q, seqs, s.slots, rows=rows)
    ends = torch.cumsum(torch.tensor([n for n, _ in seqs]), 0).tolist()
    picked = torch.cat([out[e - min(rows, n):e] for e, (n, _) in zip(ends, seqs)])
    assert_prefill_close(picked, ref64)



# --- a sliding window -----------------------------------------------------------------------------

# (new tokens, tokens cached before them) per sequence of one prefill step, under a window of 40 (not
# a multiple of 16 or of a key tile) unless the case names another
WINDOW_CASES = {
    # whole prompts shorter than, as long as and longer than the window (nothing given back yet:
    # each row masks its own window's start)
    "prompts": [(1, 0), (39, 0), (40, 0), (41, 0), (100, 0), (1000, 0)],
    # chunks that start before the window's length and end past it, and chunks far past it (the
    # blocks before the first row's window given back), beside decoding rows
    "chunks across the window": [(1, 999), (64, 20), (64, 50), (64, 100), (130, 300), (1, 30), (200, 37)],
    # a tile's rows whose windows start in different key tiles (a row may see none of a tile a
    # warp reads: its softmax stays at zeros there)
    "rows across key tiles": [(128, 3000), (256, 2000), (77, 4001)],
}


def _window_prefill_case(geometry, seqs, window, monkeypatch, block_size=None, fp8=False, seed=31, layer=1):
    """One prefill step's attention under a sliding window against float64 (every row) and the
    torch reference; our kernels only (cuDNN never takes a windowed model)."""
    from test_cuda_decode import WindowSetup, window_reference_fp64

    lengths = [n + c for n, c in seqs]
    s = WindowSetup(geometry, lengths, [c for _, c in seqs], window, seed=seed, block_size=block_size, fp8=fp8,
                    max_model_len=max(lengths) + 16)
    assert not s.cuda.cudnn_prefill and "sliding_window" in s.cuda.cudnn_prefill_missing
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
    assert_prefill_close(out, window_reference_fp64(s, layer, q, seqs, s.slots))
    return s


@pytest.mark.parametrize("geometry", [g for g, spec in GEOMETRIES.items() if spec.dtype != torch.float32])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_prefill_attend_a_sliding_window(geometry, case, monkeypatch):
    s = _window_prefill_case(geometry, WINDOW_CASES[case], 40, monkeypatch)
    assert case == "prompts" or s.freed.numel() > 0, "no block was given back: the case tests nothing"


@pytest.mark.parametrize("block_size", [8, 32, 64])
@pytest.mark.parametrize("window", [40, 1, 100])
def test_prefill_attend_a_sliding_window_every_block_size(block_size, window, monkeypatch):
    seqs = WINDOW_CASES["chunks across the window"]
    _window_prefill_case("llama1b", seqs, window, monkeypatch, block_size=block_size)


@pytest.mark.parametrize("window", [1500, 4096])
def test_prefill_attend_a_sliding_window_with_split_keys(window, monkeypatch):
    """Short chunks after long prefixes, too few tiles to fill the GPU: their keys, from the tile
    holding the first row's window's first key, split into parts (cuda_launch.key_parts counts the
    window's tiles) and merged; 4,096 is Mistral-7B-v0.1's (wider than the first chunk's prefix)."""
    seqs = [(1, 700), (60, 4000), (37, 5000), (130, 2500)]
    s = _window_prefill_case("llama1b", seqs, window, monkeypatch)
    assert s.cuda._prefill_work.tile_parts.max().item() > 1, "no tile's keys were split"


@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32"])
def test_prefill_attend_a_sliding_window_over_an_fp8_pool(geometry, monkeypatch):
    for case in ("chunks across the window", "rows across key tiles"):
        s = _window_prefill_case(geometry, WINDOW_CASES[case], 40, monkeypatch, block_size=8, fp8=True)
        assert s.freed.numel() > 0
