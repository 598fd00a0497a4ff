"""The CUDA backend's elementwise kernels against the torch reference backend, on a GPU: RoPE with
the K/V write (for prefill and decode, by vectors and by elements), rms_norm, the residual add with
the norm after it, silu_mul. How the caches are set up, and the tolerances: cuda_checks.py."""

from __future__ import annotations

import pytest
import torch

from cuda_checks import DEVICE, GEOMETRIES, Setup, assert_ulp_close, forbid_torch_fallback, poison_allocator
from helpers import rope_kernel, spy_launches, use_rope_width
from pagedcli.backends import composed
from pagedcli.backends.cuda import cuda_available

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    from pagedcli.core.batch import StepBatch


# --- RoPE + K/V write -----------------------------------------------------------------------------

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
    before = s.cache.store.pool.clone()

    s.ref.prepare(batch)
    q_ref = s.ref.rope_write_kv(layer, q, k, v, batch)
    pool_ref = s.cache.store.pool.clone()

    s.cache.store.pool.copy_(before)
    poison_allocator(q_ref.shape, dtype=s.dtype)
    s.cuda.prepare(batch)
    launched = spy_launches(s.cuda)
    q_cuda = s.cuda.rope_write_kv(layer, q, k, v, batch)
    torch.cuda.synchronize()
    assert launched == [rope_kernel(s, width)]

    assert_ulp_close(q_cuda, q_ref)
    changed = (s.cache.store.pool != before).flatten(2).any(-1)  # [blocks, 2]: which K/V halves we wrote
    assert changed.any()
    assert_ulp_close(s.cache.store.pool, pool_ref)  # the written rows, and nothing else touched
    assert torch.equal(s.cache.store.pool[:, 1], pool_ref[:, 1]), "V is a plain copy"
    if width == "vectors":  # the one-element kernel's arithmetic, element for element
        pool_vectors = s.cache.store.pool.clone()
        s.cache.store.pool.copy_(before)
        use_rope_width(monkeypatch, "elements")
        q_elements = s.cuda.rope_write_kv(layer, q, k, v, batch)
        torch.cuda.synchronize()
        assert torch.equal(q_cuda, q_elements) and torch.equal(pool_vectors, s.cache.store.pool)


# --- norms and activations ------------------------------------------------------------------------

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
