"""The CUDA backend's kernels for fp8 weights (`--quantization fp8`) against float64 and the torch
reference, on a GPU: gemv.cu's fp8 GEMV (W8A16, small batches), fp8_quant.cu's per-row activation
quantization byte for byte, and the W8A8 GEMM past W8A16_MAX_ROWS rows with the layer steps and the
LM head over it. (The fp8 KV cache's kernels: test_gpu_fp8_kv.py.) How the caches are set up, and
the tolerances: cuda_checks.py."""

from __future__ import annotations

import pytest
import torch

from cuda_checks import ACCUMULATION_FP8, ULP, Setup, Shape, assert_ulp_close
from pagedcli.backends.cuda import cuda_available

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    from pagedcli.backends.cuda import CudaBackend
    from pagedcli.backends.cuda_gemv import gemv


# --- fp8 weights ----------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", ["llama1b", "fp16"])
@pytest.mark.parametrize("op", ["rms_norm_store", "rms_norm_float", "rms_norm_silu_mul", "plain_add"])
@pytest.mark.parametrize("rows", [1, 2])
# qkv's (split K at batch 1); K past a whole tile of 2,048 fp8 weights; many rows; one 16-byte load
@pytest.mark.parametrize("shape", [
    pytest.param(Shape(n=3072, k=2048), id="qkv-3072x2048"),
    pytest.param(Shape(n=1040, k=2064), id="k-past-a-tile-1040x2064"),
    pytest.param(Shape(n=20000, k=256), id="many-rows-20000x256"),
    pytest.param(Shape(n=64, k=16), id="one-load-64x16"),
])
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
    be = CudaBackend(s.cache.store, s.config, fp8_weights=True)
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
    from pagedcli.model.fp8 import quantize_rows
    from pagedcli.core.fp8 import raw

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
# qkv's; a down projection's long K; K past a whole tile
@pytest.mark.parametrize("shape", [
    pytest.param(Shape(n=3072, k=2048), id="qkv-3072x2048"),
    pytest.param(Shape(n=2048, k=8192), id="down-2048x8192"),
    pytest.param(Shape(n=1040, k=2064), id="k-past-a-tile-1040x2064"),
])
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
