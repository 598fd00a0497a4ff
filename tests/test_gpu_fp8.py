"""FP8 on the GPU: the CUDA backend with an fp8 pool and fp8 weights against the torch reference
(on the CPU, and on the same GPU), on shuffled pools, through whatever serves each op (an fp8
pool's write and attention are our kernels: test_gpu_fp8_kv.py tests them one by one); gemv.cu's
gemv8_ kernels (W8A8, fp8 weights at decode) against a float64 W8A8 product, on tensor cores and in
sm_80's conversion kernel; and torch._scaled_mm (fp8 weights past gemv.cu's rows) against the
float32 emulation. Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_checkpoint
from helpers import check_block_accounting, record_logits
from pagedcli.engine.sequence import SamplingParams
from pagedcli.model.fp8 import FP8_DTYPE, Fp8Weight, fp8_linear, quantize_rows, quantize_weight
from pagedcli.model.loader import EngineOptions, build_engine, load_model


def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")]

FP8_OPTIONS = [("fp8", "none"), ("auto", "fp8"), ("fp8", "fp8")]
# float32 on both devices: the values before each fp8 rounding agree to float32's rounding, so a
# value on a rounding boundary may round the other way; one e4m3 step (2^-3 relative) of one K or V
# element moves a logit of these models by well under this
LOGIT_ATOL = 5e-2


def assert_same_until_a_near_tie(tokens, want_tokens, logits, want_logits):
    """Each sequence's logits agree step by step; the greedy tokens too, except where the
    reference's two best logits are nearer than the tolerance allows telling apart (after such a
    step the two texts part and nothing more is compared)."""
    for a, b, la, lb in zip(tokens, want_tokens, logits, want_logits):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(la[i], lb[i], rtol=0, atol=LOGIT_ATOL)
            if x != y:
                best, second = lb[i].topk(2).values.tolist()
                assert best - second < 2 * LOGIT_ATOL, f"step {i}: tokens {x} and {y} differ without a near-tie"
                break


def run(model_folder, device: str, kv: str, quant: str, prompts, steps: int, **kw):
    opts = EngineOptions(model=str(model_folder), device=device, dtype="float32", batch=len(prompts),
                         kv_cache_dtype=kv, quantization=quant, shuffle_blocks=17, **kw)
    model = load_model(opts)
    engine = build_engine(model, opts)
    seen = record_logits(engine)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    return engine, [s.output_token_ids for s in seqs], [torch.stack(seen[s.id]).cpu() for s in seqs]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("kv,quant", FP8_OPTIONS)
def test_stories260k_fp8_on_cuda_equals_the_cpu_torch_path(stories, kv, quant, eager):
    prompts = [[1], [1, 403, 407, 261, 378], list(range(5, 45))]
    engine, tokens, logits = run(stories, "cuda", kv, quant, prompts, 60, eager=eager, num_blocks=5 * 60)
    if kv == "fp8":
        assert engine.cache.pool.dtype == FP8_DTYPE and engine.cache.kv_scales.k.is_cuda
    _, want_tokens, want_logits = run(stories, "cpu", kv, quant, prompts, 60, num_blocks=5 * 60)
    assert_same_until_a_near_tie(tokens, want_tokens, logits, want_logits)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("kv,quant", FP8_OPTIONS)
def test_cuda_backend_equals_torch_backend_with_fp8(tmp_path, head_dim, gqa, kv, quant):
    """Same GPU, same fp8 pool and weights, only the backend differs; decode at batches 1 and 3
    (gemv.cu's sizes and cuBLAS's) and a prefill of a long prompt beside short ones."""
    from pagedcli.backends import TorchBackend

    kv_heads = 2
    hidden = kv_heads * gqa * head_dim
    # hf_checkpoint's initializer_range suits its hidden size of 64; wider models get it scaled down
    # by sqrt(64 / hidden), so that activations keep their size and the model is not chaotic
    folder = hf_checkpoint(tmp_path / "m", num_attention_heads=kv_heads * gqa, num_key_value_heads=kv_heads,
                           head_dim=head_dim, hidden_size=hidden, intermediate_size=256, max_position_embeddings=512,
                           initializer_range=0.15 * (64 / hidden) ** 0.5)
    for batch in (1, 3):
        prompts = [list(range(3, 3 + 70)), [5, 6, 7], [9] * 20][:batch]
        opts = EngineOptions(model=str(folder), device="cuda", dtype="float32", batch=batch, shuffle_blocks=3,
                             kv_cache_dtype=kv, quantization=quant, eager=True)
        model = load_model(opts)
        ours = build_engine(model, opts)
        reference = build_engine(model, opts)
        reference.runner.model.backend = TorchBackend(reference.cache, model.source.config)
        seen = [record_logits(e) for e in (ours, reference)]
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        a = [s.output_token_ids for s in ours.run_to_completion(prompts, params)]
        b = [s.output_token_ids for s in reference.run_to_completion(prompts, params)]
        assert_same_until_a_near_tie(a, b, *([torch.stack(v) for v in x.values()] for x in seen))


def test_fp8_pool_on_cuda_holds_twice_the_blocks_of_bf16(stories):
    blocks = {}
    for kv in ("auto", "fp8"):
        opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", kv_cache_dtype=kv, cache_size="64MiB")
        engine = build_engine(load_model(opts), opts)
        blocks[kv] = engine.cache.geometry.num_blocks
        assert engine.cache.pool.numel() * engine.cache.pool.element_size() == engine.cache.geometry.pool_bytes
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_gpu_memory_utilization_gives_an_fp8_pool_twice_the_blocks(stories):
    """The same share of the GPU, the same bytes for the pool: twice the blocks at a byte an element."""
    blocks = {}
    for kv in ("auto", "fp8"):
        opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                             gpu_memory_utilization=0.02)  # ~2.8 GB on an H200
        engine = build_engine(load_model(opts), opts)
        blocks[kv] = engine.cache.geometry.num_blocks
        del engine
    # (the two profiling passes may measure slightly different activation memory)
    assert abs(blocks["fp8"] / blocks["auto"] - 2) < 0.05, blocks


# --- gemv.cu's gemv8_ kernels: W8A8 at decode -------------------------------------------------------
# fp8 tensor cores add the products of one mma with fewer bits than fp32 keeps (about 14: DeepSeek-V3's
# report, section 3.3.2); gemv8_mma adds each mma's result in fp32, so its error is at most this
# share of the sum of |terms| beyond fp32's (a wrong fragment order is off by whole terms)
TENSOR_CORE_SUM = 2.0**-12


def w8a8_exact(staged: torch.Tensor, w: Fp8Weight, tensor_cores: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 product of the staged input in float64 (model/fp8.py's definition: the rows quantized
    with their own scales), and the bound on its summation error: fp32's, K * 2^-24 * sum |terms|,
    or on tensor cores TENSOR_CORE_SUM of sum |terms| where that is more."""
    values, scale = quantize_rows(staged)
    a, b = values.double() * scale.double()[:, None], w.values.double() * w.scale.double()[:, None]
    magnitude = a.abs() @ b.abs().T
    return a @ b.T, max(w.shape[1] * 2.0**-24, TENSOR_CORE_SUM if tensor_cores else 0.0) * magnitude


# gemv.cu's gemv8_ paths (cuda_build.GEMV8_MMA): tensor cores with each GPU's operands (sm_90: fp16),
# tensor cores with e4m3 operands, sm_80's conversion kernel (on any GPU)
GEMV8_PATHS = {"mma": 1, "mma-e4m3": 2, "convert": 0}


def kernels_setup(geometry, lengths, seed, path="mma"):
    """test_cuda_kernels' Setup (a shuffled pool, both backends), its CUDA backend built with one of
    GEMV8_PATHS, whatever this GPU is."""
    import pagedcli.backends.cuda_build as cuda_build
    from test_cuda_kernels import Setup

    setting = GEMV8_PATHS[path]
    if setting and torch.cuda.get_device_capability() < cuda_build.GEMV8_MMA_CAPABILITY:
        pytest.skip("no fp8 tensor cores on this GPU (sm_89+)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_build, "GEMV8_MMA", setting)
        s = Setup(geometry, lengths, seed=seed)
        assert s.cuda.fp8_operands == cuda_build.gemv8_operands(torch.cuda.get_device_capability())
    assert s.cuda.fp8_mma == bool(setting)
    return s


def same_split(s, op, N, K, monkeypatch):
    """The store kernel summed as the fused kernel of `op` sums (its units of work: 16 rows, or 8
    pairs; in the conversion kernel 1 row or 1 pair), so their results may be compared exactly."""
    from pagedcli.backends.cuda_launch import LaunchShapes

    paired = op.endswith(("silu_mul", "rope_kv"))
    if s.cuda.fp8_mma:
        split = s.cuda.shapes.gemv8_split(-(-N // 16), K)
        monkeypatch.setattr(LaunchShapes, "gemv8_split", lambda self, units, K: split)
    else:
        split = s.cuda.shapes.gemv_split(N // 2 if paired else N, K, 1)
        monkeypatch.setattr(LaunchShapes, "gemv_split", lambda self, units, K, *_: split)


GEMV8_ROWS = [1, 2, 3, 4, 5, 8]
# (N, K): Llama-3.2-1B's qkv, o, gate/up and down; N and K past whole units and tiles (1000 rows:
# 62.5 units of 16; K 2064: 16 past a 64-k block); one 16-byte load of K
GEMV8_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1000, 2064), (64, 16)]


@pytest.mark.parametrize("path", list(GEMV8_PATHS))
@pytest.mark.parametrize("geometry", ["llama1b", "fp16", "mha-d64-fp32"])
@pytest.mark.parametrize("op", ["rms_norm_store", "rms_norm_float", "rms_norm_silu_mul", "plain_add"])
@pytest.mark.parametrize("rows", GEMV8_ROWS)
@pytest.mark.parametrize("shape", GEMV8_SHAPES)
def test_gemv8_matches_fp64_w8a8_reference(path, geometry, op, rows, shape, monkeypatch):
    """gemv8_ against the float64 W8A8 product of the same staged input (RMSNormed as the reference
    backend does): within an ulp of the dtype plus float32 summation error (the float op, an fp8 LM
    head's, stores the dtype's rounding as float32); the residual add rounds once more; silu-mul is
    silu_mul of the kernel's own store output, summed alike."""
    from pagedcli.backends import cuda_build
    from pagedcli.backends.cuda_gemv import gemv
    from test_cuda_kernels import ULP, assert_ulp_close

    N, K = shape
    s = kernels_setup(geometry, [16], seed=13, path=path)
    bucket = next(b for b in cuda_build.GEMV8_ROW_BUCKETS if b >= rows)
    x = s.randn(rows, K, scale=2.0)
    x[0, 0] = 30.0  # an outlier: this row's scale is set by it, the others' are not
    weight = quantize_weight(s.randn(N, K, scale=K**-0.5))
    norm_weight = s.randn(K, scale=0.5) + 1
    residual = s.randn(rows, N)
    before = residual.clone()
    out = gemv(s.cuda, op, x, weight, norm_weight, 1e-5, residual=residual)
    if cuda_build.gemv8_shared_bytes(bucket, K, x.element_size(), op, s.cuda.fp8_operands) > cuda_build.GEMV8_MAX_SHARED:
        assert out is None, "past gemv.cu's staging limit the caller's torch path takes it"
        return
    assert out is not None, "gemv.cu's fp8 kernel did not take the shape"
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    if op == "rms_norm_silu_mul":
        same_split(s, op, N, K, monkeypatch)
        expected = s.ref.silu_mul(gemv(s.cuda, "rms_norm_store", x, weight, norm_weight, 1e-5))
        fp32 = s.dtype == torch.float32  # no rounding to hide an expf that differs by an ulp
        assert_ulp_close(out, expected, ulps=4.0 if fp32 else 2.0, min_identical=0.5 if fp32 else 0.99)
        return
    staged = s.ref.rms_norm(x, norm_weight, 1e-5) if op != "plain_add" else x
    exact, slack = w8a8_exact(staged, weight, tensor_cores=s.cuda.fp8_mma)
    if op == "plain_add":
        assert out.data_ptr() == residual.data_ptr()
        product, rounding = out.double() - before.double(), ULP[s.dtype] * (before.double().abs() + exact.abs())
    else:
        product, rounding = out.double(), ULP[s.dtype] * exact.abs()
    excess = ((product - exact).abs() - rounding - slack).max().item()
    worst = ((product - exact).abs() / (rounding + slack)).max().item()
    assert excess <= 0, (f"{op}: off the fp64 W8A8 product by {excess} beyond an ulp plus accumulation error "
                         f"({worst:.2f} of the bound)")
    # the activations are quantized (W8A8), not the dtype's values times the weights
    w8a16 = staged.double() @ weight.dequantize(torch.float64).T
    assert ((product - w8a16).abs() > rounding + slack).any()


@pytest.mark.parametrize("path", list(GEMV8_PATHS))
@pytest.mark.parametrize("geometry", ["llama1b", "gqa8-d128-b32", "mha-d64-fp32"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_gemv8_rope_kv_equals_its_store_then_kv_write(path, geometry, rows, monkeypatch):
    """gemv8_'s qkv kernel: q and the pool as its own store kernel's output (summed alike) after
    kv_write.cu, at head_dim 64 and 128, a padding row among the tokens."""
    from test_cuda_kernels import assert_ulp_close, forbid_torch_fallback

    lengths = [40, 300, 17, 5, 64, 1, 90, 33][:rows]
    s = kernels_setup(geometry, lengths, seed=14, path=path)
    c, layer = s.config, 1
    batch = s.decode_batch(lengths)
    if rows > 1:
        batch.positions[1], batch.context_lens[1] = -1, 0  # a padding row
    x = s.randn(rows, c.hidden_size, scale=2.0)
    qkv = quantize_weight(s.randn(c.q_dim + 2 * c.kv_dim, c.hidden_size, scale=c.hidden_size**-0.5))
    norm_weight = s.randn(c.hidden_size) + 1
    pool0 = s.cache.pool.clone()

    s.cuda.prepare(batch)
    same_split(s, "rms_norm_rope_kv", qkv.shape[0], c.hidden_size, monkeypatch)
    projected = s.cuda.norm_linear(x, norm_weight, qkv, 1e-5)
    q, k, v = projected.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
    q_ref = s.cuda.rope_write_kv(layer, q.view(rows, c.num_heads, c.head_dim),
                                 k.view(rows, c.num_kv_heads, c.head_dim), v.view(rows, c.num_kv_heads, c.head_dim),
                                 batch)
    torch.cuda.synchronize()
    pool_ref = s.cache.pool.clone()
    assert not torch.equal(pool_ref, pool0)

    s.cache.pool.copy_(pool0)
    forbid_torch_fallback(monkeypatch, "attention_inputs")
    q_fused = s.cuda.attention_inputs(layer, x, norm_weight, qkv, 1e-5, batch)
    torch.cuda.synchronize()
    fp32 = s.dtype == torch.float32
    assert_ulp_close(q_fused, q_ref, ulps=2.0, min_identical=0.5 if fp32 else 0.99)
    assert_ulp_close(s.cache.pool, pool_ref, ulps=2.0, min_identical=0.99)


def test_gemv8_paths_compute_the_same_function():
    """The gemv8_ paths on the same inputs: the same W8A8 function, summed in other orders."""
    from pagedcli.backends.cuda_gemv import gemv

    outs = []
    for path in ("convert", "mma", "mma-e4m3"):
        if path != "convert" and torch.cuda.get_device_capability() < (8, 9):
            continue
        s = kernels_setup("llama1b", [16], seed=21, path=path)
        x = s.randn(4, 2048, scale=2.0)
        w = quantize_weight(s.randn(3072, 2048, scale=2048**-0.5))
        outs.append(gemv(s.cuda, "rms_norm_store", x, w, s.randn(2048) + 1, 1e-5).float())
    for other in outs[1:]:
        diff = (other - outs[0]).abs()
        assert (diff <= 2.0**-7 * outs[0].abs() + 1e-3).all() and (diff == 0).float().mean() > 0.9


def test_scaled_mm_matches_the_float32_emulation_on_the_gpu():
    """Past gemv.cu's rows (prefill, larger batches) fp8 weights go through torch._scaled_mm where the
    backend's probe found it working: the same W8A8 function as the float32 emulation."""
    from pagedcli.model.fp8 import fp8_gemm_refusal

    device = torch.device("cuda")
    why = fp8_gemm_refusal(device, torch.bfloat16)
    if why is not None:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for M, N, K in ((9, 3072, 2048), (128, 2048, 8192), (300, 16384, 2048)):
        x = torch.randn(M, K, generator=gen, device=device).to(torch.bfloat16)
        x[0] *= 100  # a loud row: its own scale
        w = quantize_weight(torch.randn(N, K, generator=gen, device=device) * K**-0.5)
        got, want = fp8_linear(x, w, scaled_mm=True), fp8_linear(x, w)
        exact, slack = w8a8_exact(x, w)
        assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + slack).all()
        assert (got == want).float().mean() > 0.9


def test_cuda_backend_probes_scaled_mm_once_and_says_so_when_refused(stories, monkeypatch):
    import pagedcli.backends.torch as torch_backend

    calls = []

    def refused(device, dtype):
        calls.append((device, dtype))
        return "torch._scaled_mm refused it: test"

    monkeypatch.setattr(torch_backend, "fp8_gemm_refusal", refused)
    notices = []
    opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", quantization="fp8")
    engine = build_engine(load_model(opts), opts, notice=notices.append)
    assert len(calls) == 1 and not engine.runner.model.backend.fp8_gemm
    assert any("refused it: test" in n and "emulate" in n for n in notices), notices
