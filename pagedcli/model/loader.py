"""From command-line options to a ready Engine: pick the device and dtype, read the model, size
the pool, choose the backend. The CLI, the benchmark and the tests all build engines here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from pagedcli.backends import TorchBackend
from pagedcli.engine.cache import MAX_ID, KVCache
from pagedcli.defaults import DEFAULT_CACHE, DEFAULTS, default_max_batched_tokens
from pagedcli.model.config import CacheGeometry, parse_size
from pagedcli.model.fp8 import FP8_DTYPE, KV_CACHE_DTYPES, QUANTIZATIONS
from pagedcli.engine.engine import Engine
from pagedcli.errors import UsageError
from pagedcli.model.memory import MemoryProfile, check_fraction, device_memory, pool_bytes_for
from pagedcli.model.network import Llama
from pagedcli.model.source import ModelSource, resolve_model
from pagedcli.engine.runner import ModelRunner
from pagedcli.engine.sequence import SamplingParams
from pagedcli.engine.scheduler import UNCHUNKED_MAX_BATCHED_TOKENS
from pagedcli.model.tokenizer import StreamDecoder, Tokenizer
from pagedcli.model.weights import Weights, load_weights, random_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMALL_MODEL_BYTES = 64 << 20


@dataclass
class EngineOptions:
    model: str | None = None
    device: str = DEFAULTS.device
    dtype: str = DEFAULTS.dtype
    batch: int = DEFAULTS.batch
    block_size: int = DEFAULTS.block_size
    num_blocks: int | None = None
    cache_size: str | None = None  # e.g. "2GiB"; default by device
    max_model_len: int | None = None
    eager: bool = DEFAULTS.eager
    overlap: bool = DEFAULTS.overlap
    shuffle_blocks: int | None = None  # hand blocks out in a shuffled order (tests, demos)
    prefix_caching: bool = DEFAULTS.prefix_caching
    chunked_prefill: bool = DEFAULTS.chunked_prefill
    max_num_batched_tokens: int | None = None  # new tokens a step feeds at most; default by device and `serving`
    gpu_memory_utilization: float | None = None  # size the pool to this share of the GPU (memory.py)
    kv_cache_dtype: str = DEFAULTS.kv_cache_dtype  # auto (the model dtype) or fp8 (model/fp8.py)
    quantization: str = DEFAULTS.quantization  # none or fp8: the linear layers' and LM head's weights (model/fp8.py)
    seed: int = 0  # random weights
    serving: bool = False  # for `pagedcli serve`, whose default step budget is smaller on a GPU (defaults.py)

    def __post_init__(self):  # checked here, so before anything slow is loaded
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's other name for it
            self.kv_cache_dtype = "fp8"
        if self.batch < 1:
            raise UsageError(f"`batch` {self.batch}: needs at least one slot", "use `batch` 1 or more")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(f"`kv_cache_dtype` {self.kv_cache_dtype!r} is not known",
                             "use auto (the model's dtype) or fp8 (also fp8_e4m3)")
        if self.quantization not in QUANTIZATIONS:
            raise UsageError(f"`quantization` {self.quantization!r} is not known", f"use {' or '.join(QUANTIZATIONS)}")
        if self.batch > MAX_ID:
            raise UsageError(f"`batch` {self.batch}: more slots than the {MAX_ID:,} a block table can number",
                             "use a smaller `batch`")
        if self.gpu_memory_utilization is not None:
            check_fraction(self.gpu_memory_utilization)
            given = [f"`{name}`" for name in ("cache_size", "num_blocks") if getattr(self, name) is not None]
            if given:
                raise UsageError(f"`gpu_memory_utilization` and {given[0]} both size the pool", "give one of them")
        n = self.max_num_batched_tokens
        if n is not None and n < 1:
            raise UsageError(f"`max_num_batched_tokens` {n}: must be at least 1", "leave it out for the device's default")
        if n is not None and self.chunked_prefill and n < self.batch:
            raise UsageError(f"`max_num_batched_tokens` {n} is below `batch` {self.batch}: a step must hold a token "
                             "for every running sequence", f"use `max_num_batched_tokens` {self.batch} or more")

    def batched_tokens(self, device: torch.device) -> int:
        """The step's token budget: as given, or the default for the device and for serving or not
        (with chunked prefill at least a token per slot; without, the scheduler's own)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not self.chunked_prefill:
            return UNCHUNKED_MAX_BATCHED_TOKENS
        return max(default_max_batched_tokens(device, self.serving), self.batch)


def pick_device(requested: str) -> torch.device:
    if requested not in ("auto", "cpu", "cuda"):
        raise UsageError(f"`device` {requested!r} is not known", "use auto, cpu or cuda")
    if requested == "cpu":
        return torch.device("cpu")
    from pagedcli.backends.cuda import cuda_available  # imports CuPy only when asked

    ok, why = cuda_available()
    if requested == "cuda" and not ok:
        raise UsageError(f"`device` cuda: {why}", "use `device` cpu, or install pagedcli[cuda] on a machine with an NVIDIA GPU")
    return torch.device("cuda") if ok else torch.device("cpu")


def check_device_options(opts: EngineOptions, device: torch.device) -> None:
    # A share of the CPU's RAM would be a poor rule (the OS and other programs share it, and swap
    # hides the limit): on a CPU the pool is sized in bytes or blocks.
    if opts.gpu_memory_utilization is not None and device.type != "cuda":
        raise UsageError("`gpu_memory_utilization` sizes the pool to a share of a GPU, and this run is on the CPU",
                         "size it with `cache_size` or `num_blocks` instead")


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


def load_model(opts: EngineOptions, notice: Callable[[str], None] = lambda _: None,
               check: Callable[[ModelSource, Tokenizer | None], None] = lambda *_: None) -> Model:
    """`check(source, tokenizer)` may refuse the model before its weights are read."""
    device = pick_device(opts.device)
    check_device_options(opts, device)
    dtype = pick_dtype(opts.dtype, device)
    source = resolve_model(opts.model, notice)
    tokenizer = Tokenizer(source.folder) if source.has_tokenizer else None
    if tokenizer is not None and source.config.vocab_size > tokenizer.vocab_size:
        v, t = source.config.vocab_size, tokenizer.vocab_size
        notice(f"warning: config.json's vocab_size {v} is above the tokenizer's {t}: ids {t}-{v - 1} have no text "
               f"(fine if the vocabulary is padded; else the tokenizer is not this model's)")
    check(source, tokenizer)
    if source.random:
        weights = random_weights(source.config, dtype, device, opts.seed, opts.quantization)
    else:
        weights = load_weights(source.folder, source.config, dtype, device, opts.quantization)
    if device.type == "cpu" and weights.nbytes < SMALL_MODEL_BYTES:
        torch.set_num_threads(1)  # a few MB of weights: threads cost more in handoffs than they save
    return Model(source, tokenizer, weights, device, dtype)


def build_engine(model: Model, opts: EngineOptions, notice: Callable[[str], None] = lambda _: None) -> Engine:
    """A fresh cache, backend and engine around already loaded weights. `notice` hears of each op
    the CUDA kernels cannot serve for this model (it runs as torch ops instead)."""
    config, device = model.source.config, model.device
    check_device_options(opts, device)
    if opts.gpu_memory_utilization is not None:
        free, total = device_memory(device)
        usage = MemoryProfile(total, free, model.weights.nbytes, profile_activations(model, opts))
        cache_bytes = pool_bytes_for(opts.gpu_memory_utilization, usage)
    else:
        cache_bytes = parse_size(opts.cache_size or DEFAULT_CACHE[device.type])
    cache_dtype = FP8_DTYPE if opts.kv_cache_dtype == "fp8" else None
    geometry = CacheGeometry.build(config, model.dtype, opts.block_size, opts.num_blocks, cache_bytes, cache_dtype)
    if geometry.num_blocks > MAX_ID:
        option = f"`num_blocks` {opts.num_blocks}" if opts.num_blocks is not None else f"`cache_size` {opts.cache_size}"
        raise UsageError(f"{option}: {geometry.num_blocks:,} blocks, more than the {MAX_ID:,} a block table can number",
                         "use a smaller `cache_size` or `num_blocks`")
    pool_len = geometry.pool_tokens
    max_model_len = min(config.context_length, pool_len, opts.max_model_len or pool_len)
    if opts.max_model_len is not None and opts.max_model_len > max_model_len:  # said, not silently cut
        what = ("the model's positions (max_position_embeddings)" if max_model_len == config.context_length
                else "what the pool holds: a larger `cache_size` makes room")
        notice(f"`max_model_len` {opts.max_model_len:,} is more than {what}: sequences stop at {max_model_len:,} tokens")
    cache = KVCache(geometry, opts.batch, max_model_len, device, opts.shuffle_blocks, opts.prefix_caching,
                    kv_scales=model.weights.kv_scales)
    if device.type == "cuda":
        from pagedcli.backends.cuda import CudaBackend

        backend = CudaBackend(cache, config, fp8_weights=model.weights.quantized)
        for op, why in backend.fallbacks.items():
            notice(f"CUDA: {op} runs as torch ops on the GPU ({why})")
    else:
        backend = TorchBackend(cache, config)
    llama = Llama(config, model.weights, backend)
    runner = ModelRunner(llama, cache, use_graphs=device.type == "cuda" and not opts.eager,
                         max_step_tokens=opts.batched_tokens(device))
    tokenizer = model.tokenizer
    detokenizer = (lambda prompt_ids: StreamDecoder(tokenizer, prompt_ids)) if tokenizer is not None else None
    return Engine(runner, cache, model.source.stop_ids, overlap=opts.overlap and device.type == "cuda",
                  chunked_prefill=opts.chunked_prefill, max_num_batched_tokens=opts.batched_tokens(device),
                  detokenizer=detokenizer)


def largest_step(opts: EngineOptions, device: torch.device, context_length: int) -> list[int]:
    """The prompt lengths of the largest step the engine may run, as a profiling pass feeds it:
    a token for each slot but one (their rows of logits; first, as the scheduler puts decoding
    sequences) and one long prompt (the attention's widest). Chunked, the step's budget;
    unchunked, a whole prompt of the longest length too."""
    tokens = opts.batched_tokens(device)
    if not opts.chunked_prefill:
        tokens = max(tokens, opts.max_model_len or context_length)
    rows = min(opts.batch, tokens)
    longest = min(tokens - (rows - 1), context_length - 1)  # room for the token it samples
    return [1] * (rows - 1) + [longest]


def profile_activations(model: Model, opts: EngineOptions) -> int:
    """Peak bytes the largest step allocates beyond the weights and the pool, measured: one forward
    pass of it in an engine of its own whose pool holds just that step (vLLM's profiling run).
    CUDA only: torch's allocator counts the bytes."""
    config, device = model.source.config, model.device
    lengths = largest_step(opts, device, config.context_length)
    block_size = opts.block_size
    blocks = sum(-(-(n + 1) // block_size) for n in lengths) * config.num_layers
    probe = replace(opts, batch=len(lengths), num_blocks=blocks, cache_size=None, gpu_memory_utilization=None,
                    eager=True, overlap=False, prefix_caching=False, chunked_prefill=False,
                    max_num_batched_tokens=sum(lengths), max_model_len=None)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    engine = build_engine(model, probe)
    for n in lengths:  # one step: every prompt admitted, prefilled, and done after its one token
        engine.add_request([i % config.vocab_size for i in range(n)], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - engine.cache.geometry.pool_bytes
    del engine
    return max(peak, 0)


@dataclass
class Loaded(Model):
    """A model and an engine built around it."""

    engine: Engine


def load(opts: EngineOptions, notice: Callable[[str], None] = lambda _: None,
         check: Callable[[ModelSource, Tokenizer | None], None] = lambda *_: None) -> Loaded:
    model = load_model(opts, notice, check)
    return Loaded(**vars(model), engine=build_engine(model, opts, notice))
