"""The engine, assembled (nano-vllm's LLMEngine.__init__): from options to a ready Engine. Pick the
device, read the model (model/loader.py), size the pool, choose the backend, and put the cache,
the network, the runner and the engine together. The commands, the server, the benchmarks and the
tests all build engines here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from pagedcli.backends import cpu_kernels
from pagedcli.backends.cpu import CpuBackend
from pagedcli.backends.cuda_build import UNVERIFIED_KERNELS_VAR, unverified_kernels
from pagedcli.core.errors import UsageError
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.core.geometry import CacheGeometry, parse_size
from pagedcli.core.options import DEFAULT_CACHE, MAX_ID, EngineOptions, SamplingParams
from pagedcli.core.parallel import RankView, TensorParallelGroup
from pagedcli.engine.cache import KVCache
from pagedcli.engine.engine import Engine
from pagedcli.engine.memory import MemoryProfile, device_memory, pool_bytes_for
from pagedcli.engine.ranks import follow, join_ranks
from pagedcli.engine.runner import ModelRunner
from pagedcli.engine.structured import StructuredOutputs
from pagedcli.model.loader import DEFAULT_THREADS, Model, pick_dtype, read_model
from pagedcli.model.network import Llama
from pagedcli.model.sharding import check_divides, kv_heads_of, rank_config
from pagedcli.model.source import ModelSource, resolve_model
from pagedcli.model.tokenizer import StreamDecoder, Tokenizer


def pick_device(requested: str) -> torch.device:
    """auto, cpu or cuda (EngineOptions.device, checked there): auto is CUDA where it can run."""
    if requested == "cpu":
        return torch.device("cpu")
    from pagedcli.backends.cuda_compile import cuda_available  # imports CuPy only when asked

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


def load_model(opts: EngineOptions, notice: Callable[[str], None] = lambda _: None,
               check: Callable[[ModelSource, Tokenizer | None], None] = lambda *_: None,
               tp: TensorParallelGroup | None = None) -> Model:
    """The model the options name, on their device. `check(source, tokenizer)` may refuse the model
    before its weights are read. With `tensor_parallel_size` N > 1 this process becomes rank 0 of N
    (engine/ranks.py starts the others) and holds its share of the weights; `tp`: a worker's group."""
    device = pick_device(opts.device)
    check_device_options(opts, device)
    if opts.tensor_parallel_size > 1 and tp is None:
        check_divides(resolve_model(opts.model).config, opts.tensor_parallel_size)  # before any worker starts
        tp = join_ranks(opts)
        if tp.rank > 0:  # (torchrun's other processes) follow rank 0, and end with it
            follow(load_model(opts, tp=tp), tp)
            raise SystemExit(0)
    world = tp.world if tp is not None else 1
    threads = opts.threads
    if threads is None and world > 1 and device.type == "cpu":  # the cores shared among the ranks
        threads = max(1, DEFAULT_THREADS // world)
    model = read_model(opts.model, device, pick_dtype(opts.dtype, device), opts.quantization, opts.seed, notice, check,
                       threads=threads, shard=(world, tp.rank if tp is not None else 0))
    model.tp = tp
    return model


def build_engine(model: Model, opts: EngineOptions, notice: Callable[[str], None] = lambda _: None) -> Engine:
    """A fresh cache, backend and engine around already loaded weights. `notice` hears of each op
    the CUDA kernels cannot serve for this model (it runs as torch ops instead)."""
    config, device = model.source.config, model.device
    check_device_options(opts, device)
    world = model.tp.world if model.tp is not None else 1
    if opts.gpu_memory_utilization is not None:
        free, total = device_memory(device)
        usage = MemoryProfile(total, free, model.weights.nbytes, profile_activations(model, opts))
        cache_bytes = pool_bytes_for(opts.gpu_memory_utilization, usage)
    else:
        cache_bytes = parse_size(opts.cache_size or DEFAULT_CACHE[device.type])
    cache_dtype = FP8_DTYPE if opts.kv_cache_dtype == "fp8" else None
    # (each rank's pool holds its share of the KV heads: `cache_size` is a rank's)
    geometry = CacheGeometry.build(rank_config(config, world), model.dtype, opts.block_size, opts.num_blocks,
                                   cache_bytes, cache_dtype)
    if geometry.num_blocks > MAX_ID:
        option = f"`num_blocks` {opts.num_blocks}" if opts.num_blocks is not None else f"`cache_size` {opts.cache_size}"
        raise UsageError(f"{option}: {geometry.num_blocks:,} blocks, more than the {MAX_ID:,} a block table can number",
                         "use a smaller `cache_size` or `num_blocks`")
    # a sequence's length is capped by what the pool holds, but with a sliding window, whose sequences
    # hold only their window's blocks once their prompt is in (the prompt's are taken at admission:
    # PromptLimits keeps a prompt within the pool)
    pool_len = config.context_length if config.sliding_window else geometry.pool_tokens
    max_model_len = min(config.context_length, pool_len, opts.max_model_len or pool_len)
    if opts.max_model_len is not None and opts.max_model_len > max_model_len:  # said, not silently cut
        what = ("the model's positions (max_position_embeddings)" if max_model_len == config.context_length
                else "what the pool holds: a larger `cache_size` makes room")
        notice(f"`max_model_len` {opts.max_model_len:,} is more than {what}: sequences stop at {max_model_len:,} tokens")
    runner = build_runner(model, opts, geometry.num_blocks, max_model_len, notice)
    cache = runner.cache
    tokenizer, stop_ids = model.tokenizer, model.source.stop_ids
    detokenizer = (lambda prompt_ids: StreamDecoder(tokenizer, prompt_ids)) if tokenizer is not None else None
    # a grammar's vocabulary (engine/structured.py), made when a request first asks for one
    structured = ((lambda: StructuredOutputs(tokenizer.to_json(), config.vocab_size, stop_ids))
                  if tokenizer is not None else None)
    return Engine(runner, cache, stop_ids, overlap=opts.overlap and device.type == "cuda",
                  chunked_prefill=opts.chunked_prefill, max_num_batched_tokens=opts.batched_tokens(device),
                  detokenizer=detokenizer, structured=structured)


def build_runner(model: Model, opts: EngineOptions, num_blocks: int, max_model_len: int,
                 notice: Callable[[str], None] = lambda _: None) -> ModelRunner:
    """This rank's cache of `num_blocks` blocks, backend, network and runner. Under tensor
    parallelism rank 0 has the other ranks build theirs from the same values first (engine/ranks.py),
    and learns what each holds of the pool (`runner.ranks`)."""
    tp, device = model.tp, model.device
    world = tp.world if tp is not None else 1
    if tp is not None and tp.rank == 0:
        tp.send(("build", opts, num_blocks, max_model_len))
    config = rank_config(model.source.config, world)  # this rank's heads and columns
    cache_dtype = FP8_DTYPE if opts.kv_cache_dtype == "fp8" else None
    geometry = CacheGeometry.build(config, model.dtype, opts.block_size, num_blocks, None, cache_dtype)
    cache = KVCache(geometry, opts.batch, max_model_len, device, opts.shuffle_blocks, opts.prefix_caching,
                    sliding_window=config.sliding_window, kv_scales=model.weights.kv_scales, mirrors=world > 1)
    if device.type == "cuda":
        from pagedcli.backends.cuda import CudaBackend
        from pagedcli.backends.cuda_quant import quant_formats

        # fp8_weights: Fp8Weights (Weights.quantized); quant: the QuantWeights' formats (model/quant.py)
        backend = CudaBackend(cache.store, config, fp8_weights=model.weights.quantized,
                              quant=quant_formats(model.weights))
        for op, why in backend.fallbacks.items():
            notice(f"CUDA: {op} runs as torch ops on the GPU ({why})")
    else:  # the reference's decode step with few ops (backends/cpu.py)
        backend = CpuBackend(cache.store, config)
        backend.take_weights(model.weights)
        if why := cpu_kernels.unavailable():
            notice(f"CPU: decode's products run through oneDNN, not our kernels ({why})")
    graphs = device.type == "cuda" and not opts.eager
    if graphs and world > 1 and not unverified_kernels():
        graphs = False
        notice("CUDA graphs under `tensor_parallel_size` wait for their multi-GPU test: steps run eagerly "
               f"(set {UNVERIFIED_KERNELS_VAR}=1 to capture them)")
    runner = ModelRunner(Llama(config, model.weights, backend, tp), cache, use_graphs=graphs,
                         max_step_tokens=opts.batched_tokens(device))
    if tp is not None:  # every rank, once built: what it holds, for the view (and a barrier)
        first, stop = kv_heads_of(model.source.config, world, tp.rank)
        pool = cache.store.pool
        mine = RankView(tp.rank, str(pool.device), (first, stop), pool.data_ptr(), pool.numel() * pool.element_size())
        runner.ranks = tuple(tp.gather_objects(mine))
    return runner


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


@dataclass(kw_only=True)
class Loaded(Model):
    """A model and an engine built around it."""

    engine: Engine


def load(opts: EngineOptions, notice: Callable[[str], None] = lambda _: None,
         check: Callable[[ModelSource, Tokenizer | None], None] = lambda *_: None) -> Loaded:
    model = load_model(opts, notice, check)
    return Loaded(**vars(model), engine=build_engine(model, opts, notice))
