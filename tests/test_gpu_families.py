"""Qwen2 / Qwen2.5, Qwen3 and Mistral on the GPU, in bf16: each family preset's head geometry cut to
2 layers, against transformers' own class on the same GPU and against our torch reference on the
same pool. What is new to the CUDA path: Qwen2's q/k/v biases (cuBLAS, then the bias; the K/V write
kernel), Qwen3's head norms (cuBLAS, our RMSNorm kernel over each head, the K/V write kernel), and
a sliding window's attention (our decode and prefill kernels, compiled with SLIDING_WINDOW, inside
the CUDA graphs, over a table whose blocks behind the window are given back and reused): no
attention op falls back to torch. Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest

from test_families import FAMILY_PRESETS, family_checkpoint, run
import test_gpu_presets as gpu_presets
from test_oracle import prompts
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.engine.build import build_engine, load_model
from pagedcli.model.config import ModelConfig
from pagedcli.model.source import RANDOM_PRESETS


pytestmark = gpu_presets.pytestmark  # (gpu, and skipped without CUDA and CuPy)
STEPS, VOCAB = gpu_presets.STEPS, gpu_presets.VOCAB


def gpu_family_checkpoint(folder, name, **overrides):
    """The preset's family and heads, 2 layers, 16 hidden a head (gemv.cu's 16-byte rows apply)."""
    heads = ModelConfig.from_file(RANDOM_PRESETS[name]).num_heads
    return family_checkpoint(folder, name, hidden_size=16 * heads, intermediate_size=256, vocab_size=VOCAB,
                             **overrides)


@pytest.mark.parametrize("batch", [4, 1], ids=["cublas", "gemv"])
@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_heads_on_cuda_match_transformers(tmp_path, make_engine, name, batch):
    folder = gpu_family_checkpoint(tmp_path, name)
    loaded = make_engine(folder, device="cuda", dtype="bfloat16", batch=batch, num_blocks=256, block_size=8)
    engine = gpu_presets.answers_match_transformers(loaded, folder, f"{name} {batch}")
    if engine.cache.sliding_window:
        assert engine.cache.num_window_freed > 0
    assert_attention_is_ours(engine)


def assert_attention_is_ours(engine) -> None:
    """Decode and prefill attention run our kernels (a sliding window's too): no torch fallback."""
    backend = engine.runner.model.backend
    assert backend.attention_kernel and backend.prefill_kernel, backend.fallbacks
    assert not {"decode attention", "prefill attention"} & backend.fallbacks.keys(), backend.fallbacks


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen3-0.6b", "mistral-7b-v0.1"])
def test_the_new_ops_on_cuda_equal_the_torch_reference_on_a_shuffled_pool(tmp_path, name):
    """The same engine, pool order and GPU, only the backend differs: our kernels (and the ops the
    plan sends to torch) against the torch reference, token for token in float32."""
    from pagedcli.backends import TorchBackend

    folder = gpu_family_checkpoint(tmp_path, name)
    opts = EngineOptions(model=str(folder), device="cuda", dtype="float32", batch=3, shuffle_blocks=5, num_blocks=300,
                         block_size=8)
    model = load_model(opts)
    prompt_list = prompts([3, 20, 40], VOCAB, seed=8)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    ours = build_engine(model, opts)
    reference = build_engine(model, EngineOptions(**{**opts.__dict__, "eager": True}))
    reference.runner.model.backend = TorchBackend(reference.cache.store, model.source.config)
    a = [s.output_token_ids for s in ours.run_to_completion(prompt_list, params)]
    b = [s.output_token_ids for s in reference.run_to_completion(prompt_list, params)]
    assert a == b


LONG_WINDOW = 40  # not a multiple of the block size or of a kernel's key tile


@pytest.mark.parametrize("opts", [{"batch": 4, "chunked_prefill": False}, {"batch": 1},
                                  {"batch": 3, "max_num_batched_tokens": 48}], ids=["batch", "gemv", "chunks"])
def test_a_window_of_40_on_cuda_is_transformers_and_frees_blocks(tmp_path, make_engine, opts):
    """Mistral with a window of 40 in bf16 on our kernels (CUDA graphs): prompts of 3 to 100 tokens
    (one past the window before its answer, two sharing a prefix longer than it) and 100 new tokens
    each, in one batch, one at a time (gemv.cu), and in prefill chunks of 48 beside decoding rows;
    each token transformers' MistralForCausalLM's choice or a near-tie, the blocks behind the window
    given back as the answers grow (a slot holds at most 40 / 16 + 1 blocks a layer)."""
    import torch
    from helpers import hf_model

    folder = gpu_family_checkpoint(tmp_path, "mistral-7b-v0.1", sliding_window=LONG_WINDOW)
    shared = prompts([60], VOCAB, seed=11)[0]
    prompt_list = prompts([3, 100], VOCAB, seed=12) + [shared + [7, 8], shared + [9]]
    loaded = make_engine(folder, device="cuda", dtype="bfloat16", num_blocks=400, block_size=16, **opts)
    assert_attention_is_ours(loaded.engine)
    results, held = run(loaded, prompt_list, steps=100)
    bound = -(-LONG_WINDOW // 16) + 1
    assert held <= bound and loaded.engine.cache.num_window_freed > 0, (held, loaded.engine.cache.num_window_freed)
    hf = hf_model(folder, dtype=torch.bfloat16, device="cuda")
    near_ties = [gpu_presets.each_token_is_the_references_choice_or_a_near_tie(hf, prompt, tokens)
                 for (tokens, _), prompt in zip(results, prompt_list)]
    print("window 40", opts, "near-ties a prompt:", near_ties)
    assert sum(near_ties) <= len(prompt_list) * 100 // 10, near_ties


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_a_window_over_an_fp8_pool_on_cuda_equals_the_torch_backend(tmp_path, eager):
    """Mistral with a window of 40 and an fp8 pool: our kernels (no fallback at all) against the
    torch backend on the same GPU, greedy tokens and logits, 100 new tokens, then prompts that
    start with an earlier one (prefix-cache hits past the window)."""
    from test_gpu_fp8_kv import run_both

    folder = gpu_family_checkpoint(tmp_path, "mistral-7b-v0.1", sliding_window=LONG_WINDOW)
    first = prompts([3, 100, 45], VOCAB, seed=13)
    opts = EngineOptions(model=str(folder), device="cuda", dtype="bfloat16", batch=3, shuffle_blocks=3,
                         kv_cache_dtype="fp8", block_size=8, num_blocks=600, eager=eager)
    run_both(opts, [first, [first[1][:90] + [5, 6]]], 100)
