"""The defaults of the engine's and the requests' settings, in one place that imports nothing
heavy: EngineOptions (model/loader.py) and SamplingParams (engine/sequence.py) take theirs from
here, and so do the command line's flags (commands/options.py), which must not import torch
before a command runs."""

from __future__ import annotations

from dataclasses import dataclass


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
# New tokens a chunked step feeds at most (docs/architecture.md, "A step with chunks"): on a GPU vLLM's
# choice for one GPU, where a 1B model's step is GEMM-bound well before 8192 tokens, so larger
# chunks gain little and lengthen the decode stall; on a CPU a chunk short enough that a decoding
# stream waits a fraction of a second for it.
DEFAULT_MAX_BATCHED_TOKENS = {"cuda": 8192, "cpu": 256}
