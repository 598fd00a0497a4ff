"""The defaults of the engine's and the requests' settings, in one place that imports nothing
heavy: EngineOptions (model/loader.py) and SamplingParams (engine/sequence.py) take theirs from
here, and so do the command line's flags (commands/options.py), which must not import torch
before a command runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Defaults:
    device: str = "auto"  # auto, cpu, cuda
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    batch: int = 2  # concurrent slots, as tiny-vllm's BATCH_SIZE
    block_size: int = 16  # tokens per block, as in tiny-vllm and vLLM
    eager: bool = False  # no CUDA graphs
    overlap: bool = True  # on a GPU, queue the next decode step before this one's tokens reach the host
    prefix_caching: bool = True
    chunked_prefill: bool = True  # steps carry decode tokens and prompt chunks up to the token budget
    max_tokens: int = 256  # new tokens a request generates at most
    ignore_eos: bool = False
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8 e4m3 (vLLM's names)
    quantization: str = "none"  # none, fp8: the linear layers' and LM head's weights in float8 e4m3


DEFAULTS = Defaults()

# The pool's size by device: 2 GiB on a GPU, as tiny-vllm.
DEFAULT_CACHE = {"cuda": "2GiB", "cpu": "256MiB"}
# New tokens a chunked step feeds at most (docs/architecture.md, "A step with chunks"), by device
# and use: vLLM's (EngineArgs.get_batch_defaults), offline (its LLM class: generate, bench, chat,
# inspect-cache) and for the server (its OpenAI API server: serve, where a shorter step is a
# shorter stall of every stream being decoded). A GPU of 70 GiB or more gets the larger budgets, but
# not an A100, where vLLM measured them slower (its PR #17885); on an H200 a 16,000-token prompt
# then prefills in one step, its attention over the whole causal prompt at once. On a CPU, a chunk
# short enough that a decoding stream waits a fraction of a second for it.
LARGE_GPU_BYTES = 70 << 30
LARGE_GPU_MAX_BATCHED_TOKENS = 16384  # H100, H200, MI300X class
LARGE_GPU_SERVING_MAX_BATCHED_TOKENS = 8192
GPU_MAX_BATCHED_TOKENS = 8192  # any other GPU
GPU_SERVING_MAX_BATCHED_TOKENS = 2048
CPU_MAX_BATCHED_TOKENS = 256  # offline and serving


def default_max_batched_tokens(device: torch.device, serving: bool) -> int:
    """The step budget when none is given: on CUDA it asks the GPU for its memory and name."""
    if device.type != "cuda":
        return CPU_MAX_BATCHED_TOKENS
    if is_large_gpu(device):
        return LARGE_GPU_SERVING_MAX_BATCHED_TOKENS if serving else LARGE_GPU_MAX_BATCHED_TOKENS
    return GPU_SERVING_MAX_BATCHED_TOKENS if serving else GPU_MAX_BATCHED_TOKENS


def is_large_gpu(device: torch.device) -> bool:
    """vLLM's test for its larger budgets: 70 GiB or more, and not an A100."""
    import torch  # here, not above: the command line imports this module before torch

    props = torch.cuda.get_device_properties(device)
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()
