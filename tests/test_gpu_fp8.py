"""FP8 on the GPU: the CUDA backend with an fp8 pool and fp8 weights against the torch reference
(on the CPU, and on the same GPU), on shuffled pools, through whatever serves each op: our kernels
(an fp8 pool's write and attention, fp8 weights at 1 and 2 rows; test_gpu_fp8_kv.py tests the pool's
kernels one by one) or torch ops (cuda_build.plan_kernels' fallbacks). Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_checkpoint
from helpers import check_block_accounting, record_logits
from pagedcli.core.options import SamplingParams
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.engine.build import build_engine, load_model
from pagedcli.core.options import EngineOptions


def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")]

FP8_OPTIONS = [("fp8", "none"), ("auto", "fp8"), ("fp8", "fp8")]
# float32 on both devices: the values before each fp8 rounding agree to float32's rounding, so a
# value on a rounding boundary may round the other way; one e4m3 step (2^-3 relative) of one K or V
# element moves a logit of these models by well under this
LOGIT_ATOL = 5e-2
# fp8 weights over 2 rows (prefill, batch 3) quantize the activations too (W8A8): a step function of
# values whose sums on the fp8 tensor cores carry ~2^-13 relative error where the torch reference's
# fp32 sums carry 2^-24, so now and then one value lands on the other side of a rounding boundary,
# moved by one e4m3 step (up to 2^-3 of it), and the model carries that on. Measured on the CPU, the
# reference against itself with its rows perturbed by 1e-4 relative noise, over these tests' models,
# prompts and pools: logits apart by at most 0.25 to 0.69 a step, 0.07 to 0.13 on average (their
# spread: 1.28). The kernels' own errors are held tightly in tests/test_cuda_*.py.
W8A8_BOUNDS = dict(atol=1.0, mean_atol=0.2, tie=1.0)


def assert_same_until_a_near_tie(tokens, want_tokens, logits, want_logits, atol=LOGIT_ATOL, mean_atol=None,
                                 tie=2 * LOGIT_ATOL):
    """Each sequence's logits agree step by step (each within atol, and on average within
    mean_atol); the greedy tokens too, except where the reference's two best logits are nearer
    than `tie` (after such a step the two texts part and nothing more is compared)."""
    for a, b, la, lb in zip(tokens, want_tokens, logits, want_logits):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(la[i], lb[i], rtol=0, atol=atol)
            if mean_atol is not None:
                assert (la[i] - lb[i]).abs().mean() <= mean_atol, f"step {i}: logits apart on average"
            if x != y:
                best, second = lb[i].topk(2).values.tolist()
                assert best - second < tie, f"step {i}: tokens {x} and {y} differ without a near-tie"
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
        assert engine.cache.store.pool.dtype == FP8_DTYPE and engine.cache.store.kv_scales.k.is_cuda
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
        reference.runner.model.backend = TorchBackend(reference.cache.store, model.source.config)
        seen = [record_logits(e) for e in (ours, reference)]
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        a = [s.output_token_ids for s in ours.run_to_completion(prompts, params)]
        b = [s.output_token_ids for s in reference.run_to_completion(prompts, params)]
        w8a8 = quant == "fp8" and ours.runner.model.backend.fp8_gemm
        assert_same_until_a_near_tie(a, b, *([torch.stack(v) for v in x.values()] for x in seen),
                                     **(W8A8_BOUNDS if w8a8 else {}))


def test_w8a8_in_the_decode_graphs_computes_what_it_does_eagerly(tmp_path):
    """fp8 weights at batch 4 (W8A8: fp8_quant.cu and torch._scaled_mm, their scratch allocated in
    the capture) replayed from the decode graphs against the same engine run eagerly, in bf16 (the
    bench's dtype): the same greedy tokens and logits, within W8A8's noise."""
    folder = hf_checkpoint(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           hidden_size=512, intermediate_size=1024, max_position_embeddings=512,
                           initializer_range=0.15 * (64 / 512) ** 0.5)
    prompts = [list(range(3, 40)), [5, 6, 7], [9] * 20, list(range(100, 117))]
    runs = []
    for eager in (False, True):
        opts = EngineOptions(model=str(folder), device="cuda", dtype="bfloat16", batch=4, shuffle_blocks=5,
                             quantization="fp8", eager=eager)
        engine = build_engine(load_model(opts), opts)
        assert engine.runner.model.backend.fp8_gemm, engine.runner.model.backend.fallbacks
        assert (engine.runner.graphs is None) == eager
        seen = record_logits(engine)
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        tokens = [s.output_token_ids for s in engine.run_to_completion(prompts, params)]
        runs.append((tokens, [torch.stack(v).float().cpu() for v in seen.values()]))
    (graphed, graphed_logits), (eager_tokens, eager_logits) = runs
    assert_same_until_a_near_tie(graphed, eager_tokens, graphed_logits, eager_logits, **W8A8_BOUNDS)


def test_fp8_pool_on_cuda_holds_twice_the_blocks_of_bf16(stories):
    blocks = {}
    for kv in ("auto", "fp8"):
        opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", kv_cache_dtype=kv, cache_size="64MiB")
        engine = build_engine(load_model(opts), opts)
        blocks[kv] = engine.cache.geometry.num_blocks
        assert engine.cache.store.pool.numel() * engine.cache.store.pool.element_size() == engine.cache.geometry.pool_bytes
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
