"""Shared fixtures: the small freely licensed assets in tests/assets (stories260K, a slice of tiny
Shakespeare), what cannot ship with the repo found in a `shared` folder (PAGEDCLI_SHARED, or
../shared beside the checkout), tiny random Llama checkpoints written by transformers (the oracle),
and an engine factory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# the tests run the kernels that wait for their GPU tests too (backends/cuda_build.py says which)
os.environ.setdefault("PAGEDCLI_UNVERIFIED_KERNELS", "1")
ASSETS = REPO / "tests" / "assets"

# What the tests read but the repo does not ship, and why (the skip reason a fresh clone shows).
UNSHIPPED = {
    "tokenizers/llama3": "the Llama 3 tokenizer (Llama 3 Community License: not redistributed here)",
    "configs/Llama-3.2-1B-Instruct": "Meta's config.json of Llama-3.2-1B-Instruct (Llama 3.2 Community License: not redistributed here)",
}


def shared_asset(relative: str) -> Path | None:
    """`relative` inside PAGEDCLI_SHARED, ../shared beside the checkout, or ./shared; None if in none."""
    for folder in (os.environ.get("PAGEDCLI_SHARED"), REPO.parent / "shared", REPO / "shared"):
        if folder and (Path(folder) / relative).exists():
            return Path(folder) / relative
    return None


def unshipped(relative: str) -> Path:
    """An asset the repo cannot ship, or a skip that names it and where to put it."""
    path = shared_asset(relative)
    if path is None:
        pytest.skip(f"needs {UNSHIPPED[relative]}: set PAGEDCLI_SHARED to a folder with {relative}/")
    return path


@pytest.fixture(scope="session")
def stories() -> Path:
    """stories260K (llama2.c, MIT), shipped in tests/assets."""
    return ASSETS / "stories260K"


@pytest.fixture(scope="session")
def llama3_tokenizer() -> Path:
    return unshipped("tokenizers/llama3")


@pytest.fixture(scope="session")
def llama_1b_config() -> Path:
    return unshipped("configs/Llama-3.2-1B-Instruct") / "config.json"


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core runner


def hf_checkpoint(folder: Path, seed: int = 0, model_type: str = "llama", **overrides) -> Path:
    """A random checkpoint of transformers' class for `model_type` (LlamaForCausalLM by default;
    qwen2, qwen3, mistral), saved by transformers (safetensors + config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
               initializer_range=0.15)  # sharper than the default 0.02: no near-ties between top tokens
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0; vary them so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """hf_checkpoint's default model, saved once for every test that only reads it."""
    return hf_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_engine():
    from helpers import TEST_CACHE_SIZE
    from pagedcli.engine.build import load
    from pagedcli.core.options import EngineOptions

    def make(model, **opts):
        opts.setdefault("device", "cpu")
        opts.setdefault("shuffle_blocks", 1234)
        if not opts.keys() & {"num_blocks", "cache_size", "gpu_memory_utilization"}:
            opts["cache_size"] = TEST_CACHE_SIZE
        return load(EngineOptions(model=str(model), **opts))

    return make
