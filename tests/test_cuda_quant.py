"""Compressed weights (model/quant.py's QuantWeight) on the CUDA backend against the dequantized
float32 reference, on a GPU: gemv.cu's gemvq4_/gemvq8_ kernels at 1 and 2 rows with each fusion, for
4- and 8-bit values, groups of 16 to 128 and whole rows, with and without offsets, on the shapes of
every preset; the path past 2 rows (torch's int4 GEMM, or a copy dequantized once and cuBLAS); and
greedy tokens of a small model quantized at load (int4, int8) on CUDA against the CPU.

The kernels dequantize exactly as the reference does (q * scale + offset, each rounded to float32),
so at 1 and 2 rows the bound is gemv.cu's own (cuda_checks.py): an ulp of the dtype plus fp32
accumulation error of the fp64 product of the same staged input and the float32-dequantized weight;
and an input that is one column of the identity gives that column of the dequantized weight bit for
bit. Past 2 rows the int4 GEMM reads bf16 scales and zeros (cuda_quant.py): each weight within 2^-8
of its |q - 8| * |scale| + |zero| (a bf16 rounding of each, with room for one more), the product
within that and an ulp; the dense copy rounds each weight to the dtype once."""

from __future__ import annotations

import pytest
import torch

from cuda_checks import ULP, Setup, assert_ulp_close
from pagedcli.backends.cuda import cuda_available
from pagedcli.model.quant import QuantWeight

_OK, _WHY = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")]

if _OK:  # these import cupy lazily, but keep CPU-only collection free of GPU work
    from pagedcli.backends.cuda import CudaBackend
    from pagedcli.backends.cuda_build import GEMV_QUANT_CTAS_PER_SM, VEC_BYTES
    from pagedcli.backends.cuda_gemv import gemv
    from pagedcli.backends.cuda_launch import LaunchShapes

# (bits, group: a number or "row", offset): every group each source ships, with and without offsets
FORMATS = [(b, g, o) for b, groups in ((4, (16, 32, 64, 128, "row")), (8, (16, 32, 64, 128, "row")))
           for g in groups for o in (True, False)]
GEMV_OPS = ("rms_norm_store", "rms_norm_float", "rms_norm_silu_mul", "plain_add")
ROWS_CAP = 8192  # output rows of a test weight (an LM head's 128,256 loop over the grid the same way past it)


def fmt_id(f) -> str:
    bits, group, offset = f
    return f"q{bits}-g{group}-{'offset' if offset else 'no-offset'}"


def preset_shapes(cap: int = ROWS_CAP) -> list[tuple[int, int]]:
    """(N, K) of every preset's linear layers and LM head (model/presets.py): qkv, o, gate_up, down,
    the LM head, N capped (rows past the cap are the same loop)."""
    from pagedcli.model.config import ModelConfig
    from pagedcli.model.presets import RANDOM_PRESETS

    shapes = set()
    for path in RANDOM_PRESETS.values():
        c = ModelConfig.from_file(path)
        h, i = c.hidden_size, c.intermediate_size
        for n, k in ((c.q_dim + 2 * c.kv_dim, h), (h, c.q_dim), (2 * i, h), (h, i), (c.vocab_size, h)):
            shapes.add((min(n, cap), k))
    return sorted(shapes)


def random_quant(s: Setup, N: int, K: int, bits: int, group, offset: bool) -> QuantWeight:
    """Values over their whole range, scales of both signs sized so that w is about K^-0.5, offsets
    about half that (GGUF's d may be negative; AWQ's zero points make any offset)."""
    group = K if group == "row" else group
    gen, dev = s.gen, "cuda"
    if bits == 4:
        q = torch.randint(0, 256, (N, K // 2), generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)
    else:
        q = torch.randint(-128, 128, (N, K), generator=gen, device=dev, dtype=torch.int32).to(torch.int8)
    groups = K // group
    size = K**-0.5 / (8 if bits == 4 else 128)
    sign = torch.randint(0, 2, (N, groups), generator=gen, device=dev).float() * 2 - 1
    scale = (torch.rand(N, groups, generator=gen, device=dev) + 0.5) * size * sign
    off = torch.randn(N, groups, generator=gen, device=dev) * 0.5 * K**-0.5 if offset else None
    return QuantWeight(q, scale, off, bits, group, f"test{bits}")


def quant_backend(s: Setup, formats=FORMATS) -> CudaBackend:
    """The CUDA backend over s's cache with gemv_quant.cu built for these formats' bits."""
    quant = tuple(sorted({(b, 32, 64, 64) for b, _, _ in formats}))
    return CudaBackend(s.cache.store, s.config, quant=quant)


_BACKENDS: dict[str, tuple] = {}


def setup_for(geometry: str) -> tuple[Setup, CudaBackend]:
    """One Setup and quantized backend per geometry for the module (each builds gemv_quant.cu)."""
    if geometry not in _BACKENDS:
        s = Setup(geometry, [16], seed=31)
        _BACKENDS[geometry] = (s, quant_backend(s))
    return _BACKENDS[geometry]


def gemv_takes(bits: int, group) -> bool:
    return group == "row" or group >= (32 if bits == 4 else 16)


def quant_split(be, units: int, K: int, bits: int) -> int:
    """The split cuda_gemv._launch gives a compressed weight's kernel over `units` units."""
    return be.shapes.gemv_split(units, K, VEC_BYTES / (VEC_BYTES * 8 // bits), GEMV_QUANT_CTAS_PER_SM)


def reference(s: Setup, op: str, x, w: torch.Tensor, norm_weight):
    """The fp64 product of the staged input (the reference backend's RMSNorm, same roundings) and the
    float32-dequantized weight `w` (as float64), and the bound on fp32 accumulation error."""
    staged = s.ref.rms_norm(x, norm_weight, 1e-5) if op != "plain_add" else x
    exact = staged.double() @ w.T
    slack = w.shape[1] * 2.0**-24 * (staged.double().abs() @ w.abs().T)
    return exact, slack


def check_op(s: Setup, be, op: str, x, weight: QuantWeight, norm_weight, exact, slack, monkeypatch):
    """gemv.cu's compressed kernel for `op` against the fp64 reference (silu-mul against silu_mul of
    its own store output, summed with the same split)."""
    rows, (N, K) = x.shape[0], weight.shape
    residual = s.randn(rows, N)
    before = residual.clone()
    out = gemv(be, op, x, weight, norm_weight, 1e-5, residual=residual)
    assert out is not None, f"{op}: gemv.cu's compressed kernel did not take {N} x {K}"
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    if op == "rms_norm_silu_mul":
        split = quant_split(be, N // 2, K, weight.bits)
        with monkeypatch.context() as m:
            m.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)
            store = gemv(be, "rms_norm_store", x, weight, norm_weight, 1e-5)
        expected = s.ref.silu_mul(store)
        if s.dtype == torch.float32:
            assert_ulp_close(out, expected, ulps=4.0, min_identical=0.5)
        else:
            assert_ulp_close(out, expected)
        return
    if op == "rms_norm_float":
        assert out.dtype == torch.float32 and torch.equal(out, out.to(s.dtype).float())
    if op == "plain_add":
        assert out.data_ptr() == residual.data_ptr()
        product, rounding = out.double() - before.double(), ULP[s.dtype] * (before.double().abs() + exact.abs())
    else:
        product, rounding = out.double(), ULP[s.dtype] * exact.abs()
    excess = ((product - exact).abs() - rounding - slack).max().item()
    assert excess <= 0, f"{op} {N} x {K}: off the fp64 product by {excess} beyond an ulp plus accumulation error"


# --- 1 and 2 rows: gemv.cu's compressed kernels --------------------------------------------------

@pytest.mark.parametrize("fmt", [f for f in FORMATS if gemv_takes(f[0], f[1])], ids=fmt_id)
@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "stories-fp32"])
def test_quant_gemv_matches_the_dequantized_reference_on_every_preset_shape(geometry, fmt, monkeypatch):
    """Every fused op at rows 1 and 2, on every preset's (N, K) in bf16 (a few in fp16 and fp32,
    whose kernels differ only in the input's width)."""
    bits, group, offset = fmt
    s, be = setup_for(geometry)
    shapes = preset_shapes() if geometry == "llama1b" else [(3072, 2048), (1040, 8192), (8192, 576), (64, 128)]
    checked = 0
    for N, K in shapes:
        if group != "row" and K % group or (geometry != "llama1b" and K * 2 * s.dtype.itemsize > 64 * 1024):
            continue
        weight = random_quant(s, N, K, bits, group, offset)
        w = weight.dequantize(torch.float32).double()
        norm_weight = s.randn(K, scale=0.5) + 1
        for rows in (1, 2):
            if rows * K * s.dtype.itemsize > 64 * 1024:  # past gemv.cu's staging: quant_gemm (tested below)
                assert gemv(be, "rms_norm_store", s.randn(rows, K), weight, norm_weight, 1e-5) is None
                continue
            x = s.randn(rows, K, scale=2.0)
            for op in GEMV_OPS:
                exact, slack = reference(s, op, x, w, norm_weight)
                check_op(s, be, op, x, weight, norm_weight, exact, slack, monkeypatch)
                checked += 1
    assert checked >= 4 * len(GEMV_OPS)


@pytest.mark.parametrize("fmt", [(4, 128, True), (4, 32, False), (8, 16, True), (8, "row", False)], ids=fmt_id)
@pytest.mark.parametrize("split", [2, 4])
def test_quant_gemv_split_k_matches_the_dequantized_reference(fmt, split, monkeypatch):
    """Warps sharing a row, each over a slice of K (forced): K of 4 tiles of 4-bit weights (8 of
    8-bit), 1026 rows, so that the last CTA has warp groups without a row."""
    bits, group, offset = fmt
    s, be = setup_for("llama1b")
    N, K = 1026, 16384 if bits == 4 else 8192
    weight = random_quant(s, N, K, bits, group, offset)
    w = weight.dequantize(torch.float32).double()
    norm_weight = s.randn(K, scale=0.5) + 1
    monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)
    for rows in (1, 2):
        if rows * K * 2 > 64 * 1024:
            continue
        x = s.randn(rows, K, scale=2.0)
        for op in GEMV_OPS:
            exact, slack = reference(s, op, x, w, norm_weight)
            check_op(s, be, op, x, weight, norm_weight, exact, slack, monkeypatch)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if gemv_takes(f[0], f[1])], ids=fmt_id)
@pytest.mark.parametrize("geometry", ["llama1b", "stories-fp32"])
def test_quant_gemv_reads_each_weight_as_the_reference_dequantizes_it(geometry, fmt):
    """Rows of the identity in: each output is one dequantized weight, bit for bit (float32), or that
    weight rounded to bf16: every nibble position of a word, the group of each load, the offsets."""
    bits, group, offset = fmt
    s, be = setup_for(geometry)
    N, K = 520, 512
    weight = random_quant(s, N, K, bits, group, offset)
    want = weight.dequantize(torch.float32).to(s.dtype)
    columns = [0, 1, 4, 5, 6, 7, 8, 15, 16, 31, 32, 33, 127, 128, 255, 256, 300, 511]
    for a, b in zip(columns[0::2], columns[1::2]):
        x = torch.zeros(2, K, dtype=s.dtype, device="cuda")
        x[0, a] = x[1, b] = 1
        residual = torch.zeros(2, N, dtype=s.dtype, device="cuda")
        out = gemv(be, "plain_add", x, weight, residual=residual)
        assert out is not None
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[:, a]) and torch.equal(out[1], want[:, b]), (a, b)


@pytest.mark.parametrize("fmt", [(4, 128, True), (4, "row", False), (8, 32, False), (8, 16, True)], ids=fmt_id)
@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "fp16", "stories-fp32"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_quant_fused_attention_inputs_equal_gemv_then_kv_write(geometry, fmt, phase, monkeypatch):
    """The compressed qkv GEMV with RoPE and the K/V write: the q and pool bytes of its own store
    kernel followed by kv_write.cu (test_cuda_gemv.py's check for the dtype's kernel)."""
    from pagedcli.core.batch import StepBatch

    bits, group, offset = fmt
    lengths = [40, 300]
    s = Setup(geometry, lengths, seed=14)
    c, layer = s.config, 1
    if group != "row" and c.hidden_size % group:
        group = "row"
    be = quant_backend(s)
    if phase == "decode":
        batch = s.decode_batch(lengths)
        batch.positions[1], batch.context_lens[1] = -1, 0  # a padding row
    else:
        batch = StepBatch.build(True, s.slots[:1], [[5, 6]], [38], torch.device("cuda"))
    T = batch.token_ids.shape[0]
    x = s.randn(T, c.hidden_size, scale=2.0)
    qkv = random_quant(s, c.q_dim + 2 * c.kv_dim, c.hidden_size, bits, group, offset)
    norm_weight = s.randn(c.hidden_size) + 1
    pool0 = s.cache.store.pool.clone()

    be.prepare(batch)
    split = quant_split(be, qkv.shape[0] // 2, qkv.shape[1], bits)
    monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)
    store = gemv(be, "rms_norm_store", x, qkv, norm_weight, 1e-5)
    assert store is not None
    q, k, v = store.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q_ref = be.rope_write_kv(layer, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                             v.view(T, c.num_kv_heads, c.head_dim), batch)
    torch.cuda.synchronize()
    pool_ref = s.cache.store.pool.clone()
    s.cache.store.pool.copy_(pool0)
    q_fused = gemv(be, "rms_norm_rope_kv", x, qkv, norm_weight, 1e-5, rope_kv=(layer, batch))
    assert q_fused is not None
    torch.cuda.synchronize()
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(s.cache.store.pool, pool_ref)
    # and the backend's attention_inputs takes the fused kernel
    s.cache.store.pool.copy_(pool0)
    assert torch.equal(be.attention_inputs(layer, x, norm_weight, qkv, 1e-5, batch), q_ref)


def test_quant_gemv_leaves_to_the_dense_copy_what_it_does_not_take():
    """4-bit groups of 16 (no source ships them; a 16-byte load would span two): gemv returns None
    and the backend's steps give the dense copy's product, within the dtype's rounding of each
    weight; the copy is made once and kept in the weight's forms."""
    s, be = setup_for("llama1b")
    weight = random_quant(s, 1024, 2048, 4, 16, True)
    x, norm_weight = s.randn(1, 2048, scale=2.0), s.randn(2048, scale=0.5) + 1
    assert gemv(be, "rms_norm_store", x, weight, norm_weight, 1e-5) is None
    out = be.norm_linear(x, norm_weight, weight, 1e-5)
    check_dense(s, out, be.rms_norm(x, norm_weight, 1e-5), weight)  # (the rows' bytes the product read)
    be.linear_add(s.randn(1, 2048), weight, s.randn(1, 1024))
    assert sum(key[0] == "cuda_dense" for key in weight.forms) == 1


# --- over 2 rows ----------------------------------------------------------------------------------

def check_dense(s: Setup, out, x, weight: QuantWeight, base=0.0):
    """x @ w.T with w rounded to the dtype once (the dense copy), then an fp32 GEMM rounded once
    (`base`: what was added to it, rounded with it)."""
    w = weight.dequantize(torch.float32).double()
    exact = x.double() @ w.T
    size = x.double().abs() @ w.abs().T
    bound = ULP[s.dtype] * (size + exact.abs() + base) + w.shape[1] * 2.0**-24 * size
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"off the dequantized product by {excess} beyond the dense copy's roundings"


def check_int4mm(s: Setup, out, x, weight: QuantWeight, base=0.0):
    """The int4 GEMM: each weight within 2^-8 of |q - 8| * |scale| + |zero| (bf16 scales and zeros,
    a bf16 weight), the product rounded once (with `base`, what was added to it)."""
    w = weight.dequantize(torch.float32).double()
    exact = x.double() @ w.T
    groups = weight.group
    scale = weight.scale.double().repeat_interleave(groups, dim=1)
    offset = 0 if weight.offset is None else weight.offset.double().repeat_interleave(groups, dim=1)
    zero = offset + 8 * scale
    magnitude = (weight.values().double() - 8).abs() * scale.abs() + zero.abs()
    bound = 2.0**-8 * (x.double().abs() @ magnitude.T) + ULP[s.dtype] * (exact.abs() + base)
    excess = ((out.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"off the dequantized product by {excess} beyond bf16 scales' and zeros' rounding"


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "stories-fp32"])
def test_quant_past_two_rows_matches_the_dequantized_reference(geometry, fmt):
    """linear_add and norm_linear over 3, 64 and 300 rows: torch's int4 GEMM for 4-bit weights in
    bf16 in the groups it takes (the backend found its nibble order), else the dense copy; on every
    preset's shapes at 64 rows."""
    from pagedcli.backends.cuda_quant import int4mm_unsupported

    bits, group, offset = fmt
    s, be = setup_for(geometry)
    shapes = preset_shapes(4096) if geometry == "llama1b" else [(3072, 2048), (1040, 8192)]
    for N, K in shapes:
        if group != "row" and K % group:
            continue
        weight = random_quant(s, N, K, bits, group, offset)
        g = K if group == "row" else group
        tinygemm = int4mm_unsupported(bits, g, N, K, s.dtype, True) is None
        if tinygemm:
            assert be.int4mm_order is not None, be.fallbacks
        for rows in ((3, 64, 300) if (N, K) in ((3072, 2048), (1040, 8192)) else (64,)):
            x, norm_weight = s.randn(rows, K, scale=2.0), s.randn(K, scale=0.5) + 1
            residual = s.randn(rows, N)
            before = residual.clone()
            added = be.linear_add(x, weight, residual)
            normed = be.norm_linear(x, norm_weight, weight, 1e-5)
            torch.cuda.synchronize()
            check = check_int4mm if tinygemm else check_dense
            check(s, added.double() - before.double(), x, weight, before.double().abs())
            check(s, normed, be.rms_norm(x, norm_weight, 1e-5), weight)  # (the bytes the product read)
        assert any(key[0] == ("cuda_int4mm" if tinygemm else "cuda_dense") for key in weight.forms)


def test_int4mm_probe_finds_torchs_nibble_order():
    """On sm_80+ in bf16 the probe finds an order, and the packed form of a random weight gives
    torch's product of the dequantized values exactly where scales and zeros are bf16 already."""
    from pagedcli.backends.cuda_quant import int4mm_form

    s, be = setup_for("llama1b")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch's int4 GEMM needs sm_80")
    assert be.int4mm_order is not None, be.fallbacks
    for offset in (True, False):
        weight = random_quant(s, 256, 512, 4, 64, offset)
        packed, scales_and_zeros = int4mm_form(weight, be.int4mm_order)
        x = torch.eye(512, dtype=torch.bfloat16, device="cuda")  # each output row: one input's weights
        out = torch.ops.aten._weight_int4pack_mm(x, packed, 64, scales_and_zeros)
        check_int4mm(s, out, x, weight)


# --- end to end -----------------------------------------------------------------------------------

@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_model_on_cuda_equals_the_cpu_torch_path(tmp_path, quant, eager):
    """A small model quantized at load (`quantization` int4: group 128 or 64; int8: per channel), in
    float32 on both devices: the greedy tokens and logits of CUDA (gemv_quant.cu at batch 1 and 2,
    the dense copy past them) and of the CPU reference agree until a near-tie; decode at batches 1
    and 3 and a prefill of a long prompt beside short ones."""
    from conftest import hf_checkpoint
    from test_gpu_fp8 import assert_same_until_a_near_tie

    folder = hf_checkpoint(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           hidden_size=128, intermediate_size=256, max_position_embeddings=512,
                           initializer_range=0.15 * (64 / 128) ** 0.5)
    for batch in (1, 3):
        prompts = [list(range(3, 3 + 70)), [5, 6, 7], [9] * 20][:batch]
        runs = []
        for device in ("cuda", "cpu"):
            runs.append(run_model(folder, device, "float32", quant, prompts, eager=eager))
        (tokens, logits, engine), (want_tokens, want_logits, _) = runs
        backend = engine.runner.model.backend
        assert backend.quant_bits == ((4,) if quant == "int4" else (8,)), backend.fallbacks
        assert_same_until_a_near_tie(tokens, want_tokens, logits, want_logits)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_model_in_bf16_equals_the_reference_backend_on_the_gpu(tmp_path, quant):
    """bf16 (the bench's dtype; int4 past 2 rows through torch's int4 GEMM): our backend against the
    torch reference backend over the same GPU, weights and pool, near-ties aside, within bf16's noise
    (the reference dequantizes each weight to bf16 at every product)."""
    from conftest import hf_checkpoint
    from pagedcli.backends import TorchBackend
    from pagedcli.core.options import EngineOptions, SamplingParams
    from pagedcli.engine.build import build_engine, load_model
    from helpers import record_logits
    from test_gpu_fp8 import W8A8_BOUNDS, assert_same_until_a_near_tie

    folder = hf_checkpoint(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           hidden_size=512, intermediate_size=1024, max_position_embeddings=512,
                           initializer_range=0.15 * (64 / 512) ** 0.5)
    prompts = [list(range(3, 40)), [5, 6, 7], [9] * 20, list(range(100, 117))]
    opts = EngineOptions(model=str(folder), device="cuda", dtype="bfloat16", batch=4, shuffle_blocks=5,
                         quantization=quant, eager=True)
    model = load_model(opts)
    ours, reference = build_engine(model, opts), build_engine(model, opts)
    if quant == "int4":
        assert ours.runner.model.backend.int4mm_order is not None, ours.runner.model.backend.fallbacks
    reference.runner.model.backend = TorchBackend(reference.cache.store, model.source.config)
    seen = [record_logits(e) for e in (ours, reference)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    a = [s.output_token_ids for s in ours.run_to_completion(prompts, params)]
    b = [s.output_token_ids for s in reference.run_to_completion(prompts, params)]
    logits = [[torch.stack(v).float().cpu() for v in x.values()] for x in seen]
    # ours dequantizes exactly at 1 and 2 rows (the reference rounds each weight to bf16) and reads
    # bf16 scales and zeros beyond: test_gpu_fp8.py's W8A8 bounds, a bf16 model's noise, hold both
    assert_same_until_a_near_tie(a, b, *logits, **W8A8_BOUNDS)


def run_model(folder, device: str, dtype: str, quant: str, prompts, eager: bool = True, steps: int = 24):
    from helpers import check_block_accounting, record_logits
    from pagedcli.core.options import EngineOptions, SamplingParams
    from pagedcli.engine.build import build_engine, load_model

    opts = EngineOptions(model=str(folder), device=device, dtype=dtype, batch=len(prompts), shuffle_blocks=3,
                         quantization=quant, eager=eager)
    engine = build_engine(load_model(opts), opts)
    seen = record_logits(engine)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    return [s.output_token_ids for s in seqs], [torch.stack(seen[s.id]).cpu() for s in seqs], engine
