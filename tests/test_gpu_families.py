"""Qwen2 / Qwen2.5, Qwen3 and Mistral on the GPU, in bf16: each family preset's head geometry cut to
2 layers, against transformers' own class on the same GPU and against our torch reference on the
same pool. What is new to the CUDA path: Qwen2's q/k/v biases (cuBLAS, then the bias; the K/V write
kernel), Qwen3's head norms (cuBLAS, our RMSNorm kernel over each head, the K/V write kernel), and
a sliding window's attention (torch ops inside the CUDA graphs, over a table whose blocks behind the
window are given back and reused). Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest

from test_families import FAMILY_PRESETS, family_checkpoint
import test_gpu_presets as gpu_presets
from test_oracle import prompts
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.engine.build import build_engine, load_model
from pagedcli.model.config import ModelConfig
from pagedcli.model.source import RANDOM_PRESETS


pytestmark = gpu_presets.pytestmark  # (gpu, and skipped without CUDA and CuPy)
STEPS, VOCAB = gpu_presets.STEPS, gpu_presets.VOCAB


def gpu_family_checkpoint(folder, name):
    """The preset's family and heads, 2 layers, 16 hidden a head (gemv.cu's 16-byte rows apply)."""
    heads = ModelConfig.from_file(RANDOM_PRESETS[name]).num_heads
    return family_checkpoint(folder, name, hidden_size=16 * heads, intermediate_size=256, vocab_size=VOCAB)


@pytest.mark.parametrize("batch", [4, 1], ids=["cublas", "gemv"])
@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_heads_on_cuda_match_transformers(tmp_path, make_engine, name, batch):
    folder = gpu_family_checkpoint(tmp_path, name)
    loaded = make_engine(folder, device="cuda", dtype="bfloat16", batch=batch, num_blocks=256, block_size=8)
    engine = gpu_presets.answers_match_transformers(loaded, folder, f"{name} {batch}")
    if engine.cache.sliding_window:
        assert engine.cache.num_window_freed > 0


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
