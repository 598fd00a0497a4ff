"""The CUDA backend's GEMV (gemv.cu: small decode batches, with its RMSNorm, silu-mul or residual
add fused) against float64, on a GPU, split K among them, and where it hands over to cuBLAS; the qkv
GEMV with RoPE and the K/V write fused; the LM head's greedy argmax (ties, rows not finite, the
product widened to float32). How the caches are set up, and the tolerances: cuda_checks.py."""

from __future__ import annotations

import pytest
import torch

from cuda_checks import DEVICE, ULP, Setup, Shape, assert_ulp_close, forbid_torch_fallback, same_split_k_as_fused
from pagedcli.backends.cuda import cuda_available

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    import pagedcli.backends.cuda_build as cuda_build
    from pagedcli.backends.cuda_gemv import gemv
    from pagedcli.backends.cuda_launch import LaunchShapes
    from pagedcli.core.batch import StepBatch


# --- GEMV with its neighbours fused (small decode batches) ----------------------------------------

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
# qkv's; K past a whole tile; more rows than the GPU's warps take at once (as the LM head's); tiny
@pytest.mark.parametrize("shape", [
    pytest.param(Shape(n=3072, k=2048), id="qkv-3072x2048"),
    pytest.param(Shape(n=1002, k=2056), id="k-past-a-tile-1002x2056"),
    pytest.param(Shape(n=20000, k=256), id="many-rows-20000x256"),
    pytest.param(Shape(n=64, k=8), id="tiny-64x8"),
])
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


# --- the qkv GEMV with RoPE and the K/V write fused -----------------------------------------------

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
    pool0 = s.cache.store.pool.clone()

    s.cuda.prepare(batch)
    same_split_k_as_fused(monkeypatch, s, qkv)
    q, k, v = s.cuda.norm_linear(x, norm_weight, qkv, 1e-5).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q_ref = s.cuda.rope_write_kv(layer, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                                 v.view(T, c.num_kv_heads, c.head_dim), batch)
    torch.cuda.synchronize()
    pool_ref = s.cache.store.pool.clone()
    assert not torch.equal(pool_ref, pool0)  # the step wrote K/V

    s.cache.store.pool.copy_(pool0)
    forbid_torch_fallback(monkeypatch, "attention_inputs")
    q_fused = s.cuda.attention_inputs(layer, x, norm_weight, qkv, 1e-5, batch)
    torch.cuda.synchronize()
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(s.cache.store.pool, pool_ref)


# --- greedy argmax --------------------------------------------------------------------------------

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
    from pagedcli.core.batch import NOT_FINITE

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
    from pagedcli.core.batch import NOT_FINITE

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
