"""What loading reads once: the model's source, tokenizer and weights on their device (the engine
around them is assembled in engine/build.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pagedcli.core.errors import UsageError
from pagedcli.core.parallel import TensorParallelGroup
from pagedcli.model.gguf import load_gguf_weights
from pagedcli.model.sharding import check_divides, shard_weights
from pagedcli.model.source import ModelSource, resolve_model
from pagedcli.model.tokenizer import Tokenizer
from pagedcli.model.weights import Weights, load_weights, random_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMALL_MODEL_BYTES = 64 << 20
# the threads torch chose at start, the cores it sees (as llama.cpp's -t): --threads's default
DEFAULT_THREADS = torch.get_num_threads()


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if requested not in DTYPES:
        raise UsageError(f"`dtype` {requested!r} is not known", f"use one of auto, {', '.join(DTYPES)}")
    return DTYPES[requested]


@dataclass
class Model:
    """What loading reads once: the model's source, tokenizer and weights on their device."""

    source: ModelSource
    tokenizer: Tokenizer | None
    weights: Weights
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallelGroup | None = None  # the ranks this one shares the model with (tensor parallelism)


def read_model(name: str | None, device: torch.device, dtype: torch.dtype, quantization: str = "none", seed: int = 0,
               notice: Callable[[str], None] = lambda _: None,
               check: Callable[[ModelSource, Tokenizer | None], None] = lambda *_: None,
               threads: int | None = None, shard: tuple[int, int] = (1, 0)) -> Model:
    """The model `name` names (model/source.py: a folder, a GGUF file, a Hub id, `demo`, `random:<preset>`), its
    weights on `device` in `dtype` (`quantization` fp8: the linear layers' in e4m3; `seed`: random
    weights'). `check(source, tokenizer)` may refuse the model before its weights are read. On the CPU,
    torch's threads become `threads` (cpu_threads: None is the default). `shard` (world, rank): that
    rank's share of the weights under tensor parallelism (model/sharding.py)."""
    source = resolve_model(name, notice)
    tokenizer = source.read_tokenizer()
    if tokenizer is not None and source.config.vocab_size > tokenizer.vocab_size:
        v, t = source.config.vocab_size, tokenizer.vocab_size
        notice(f"warning: config.json's vocab_size {v} is above the tokenizer's {t}: ids {t}-{v - 1} have no text "
               f"(fine if the vocabulary is padded; else the tokenizer is not this model's)")
    check(source, tokenizer)
    check_divides(source.config, shard[0])
    if source.random:
        weights = random_weights(source.config, dtype, device, seed, quantization, shard)
    elif source.gguf is not None:  # (read whole, then cut: GGUF files are the small models)
        weights = shard_weights(load_gguf_weights(source.gguf, dtype, device, quantization), source.config, *shard)
    else:
        weights = load_weights(source.folder, source.config, dtype, device, quantization, shard)
    if quantization == "int4" and (left := weights.float_linears()):
        notice(f"note: {left} of the model's {len(weights.layers) * 4} linear layers stay in "
               f"{str(dtype).removeprefix('torch.')}: their inputs are not a multiple of 32 (`quantization` int4's groups)")
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(threads, weights.nbytes))
    return Model(source, tokenizer, weights, device, dtype)


def cpu_threads(requested: int | None, weight_bytes: int) -> int:
    """The threads a CPU run uses: `requested` (--threads), else every core torch sees, but 1 for a
    model of a few MB (the built-in demo): its GEMMs are too small to share, and each handoff
    between threads costs more than it saves."""
    if requested is not None:
        return requested
    return 1 if weight_bytes < SMALL_MODEL_BYTES else DEFAULT_THREADS
