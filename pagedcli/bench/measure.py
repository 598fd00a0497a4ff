"""`pagedcli bench`: how fast, how much memory, and how close to the hardware's limit.

A decode step must at least read every weight once and every cached K/V byte of the batch once,
so its floor is (weight bytes + KV bytes read) / memory bandwidth: the roofline each figure is
held against (as gpt-fast reports GB/s beside tokens/s).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedcli.bench.arrivals import Arrivals, arrival_times
from pagedcli.core.errors import RunError, UsageError, plural
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.engine.build import build_engine
from pagedcli.engine.engine import Engine
from pagedcli.model.loader import Model


# --- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    num_prompts: int | None = None  # default: one per slot
    input_len: str = "128"  # "128" or a range "100:1024"
    output_len: str = "256"
    seed: int = 0
    ignore_eos: bool = True
    prompt_file: Path | None = None
    prefix_len: int = 0  # the first prefix_len prompt tokens are the same in every prompt
    request_rate: float = math.inf  # requests a second, Poisson arrivals (arrivals.py); inf: all at the start
    structured: tuple[str, str] | None = None  # every answer held to this format (--json-schema: engine/structured.py)


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


# A run's requests are drawn before anything runs: at most this many, with at most this many random
# prompt tokens in all (a million prompts of 16 tokens, a thousand of 16k), so that a count mistyped
# (--num-prompts 1000000000, --input-len 1000000000) is one line, not memory filling for minutes
MAX_PROMPTS = 1_000_000
MAX_PROMPT_TOKENS = 1 << 24


def check_counts(w: Workload, batches: list[int]) -> None:
    """Refuse a workload past MAX_PROMPTS or MAX_PROMPT_TOKENS before anything is loaded or drawn."""
    most = w.num_prompts or max(batches)  # (default: a prompt a slot)
    given = f"--num-prompts {most:,}" if w.num_prompts else f"--batch {most:,} (a prompt a slot)"
    if most > MAX_PROMPTS:
        raise UsageError(f"{given}: more than the {MAX_PROMPTS:,} prompts a run sends at most",
                         "give fewer --num-prompts" if w.num_prompts else "give a smaller --batch, or --num-prompts")
    if w.prompt_file is None:
        longest = parse_len(w.input_len, "--input-len")[1]
        if most * longest > MAX_PROMPT_TOKENS:
            raise UsageError(f"{given} and --input-len {w.input_len}: up to {most * longest:,} random prompt tokens, "
                             f"more than the {MAX_PROMPT_TOKENS:,} a run draws at most",
                             "give fewer --num-prompts or a shorter --input-len")


def parse_len(text: str, name: str) -> tuple[int, int]:
    """'128' -> (128, 128); '100:1024' -> (100, 1024)."""
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a length", "write 128 or a range like 100:1024") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"{name} {text!r}: needs 1 <= low <= high")
    return lo, hi


def make_requests(w: Workload, n: int, vocab_size: int, avoid: set[int], tokenizer=None) -> list[Request]:
    """Random token ids (as vLLM's and nano-vllm's benchmarks), or the lines of --prompt-file."""
    rng = random.Random(w.seed)
    out_lo, out_hi = parse_len(w.output_len, "--output-len")
    if w.prompt_file is not None:
        from pagedcli.console.prompts import read_prompts

        if tokenizer is None:
            raise UsageError("--prompt-file needs a model with a tokenizer")
        lines = read_prompts([], w.prompt_file)
        prompts = [tokenizer.encode(lines[i % len(lines)]) for i in range(n)]
    else:
        in_lo, in_hi = parse_len(w.input_len, "--input-len")
        if w.prefix_len > in_lo:
            raise UsageError(f"--prefix-len {w.prefix_len} is longer than the shortest prompt "
                             f"({plural(in_lo, 'token')})")
        allowed = [t for t in range(vocab_size) if t not in avoid]
        prefix = [rng.choice(allowed) for _ in range(w.prefix_len)]
        prompts = [prefix + [rng.choice(allowed) for _ in range(rng.randint(in_lo, in_hi) - w.prefix_len)]
                   for _ in range(n)]
    return [Request(p, rng.randint(out_lo, out_hi)) for p in prompts]


# --- the arithmetic ------------------------------------------------------------------------------
def decode_weight_bytes(model: Model) -> int:
    """Weight bytes one decode step reads: everything, except that an embedding table that is not
    the LM head (untied, or beside an fp8 LM head) is only looked up (a few rows), not read whole."""
    w = model.weights
    embed = w.embed.numel() * w.embed.element_size()
    return w.nbytes - (0 if w.lm_head is w.embed else embed)


def decode_step_bytes(weight_bytes: int, kv_bytes_per_token: int, context_lens: list[int]) -> int:
    """Least bytes a decode step moves: the weights once, plus each sequence's K/V (all layers)."""
    return weight_bytes + kv_bytes_per_token * sum(context_lens)


def summarize(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    ms = sorted(v * 1e3 for v in values_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"mean": statistics.fmean(ms), "p50": statistics.median(ms), "p99": p99}


def latencies(seqs) -> tuple[list[float], list[float]]:
    """Seconds from each request's arrival to its first token (TTFT), and between the tokens of
    each (inter-token latency, ITL), as vLLM's serving benchmark counts them."""
    ttft = [s.first_token_time - s.arrival_time for s in seqs if s.first_token_time is not None]
    itl = [b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    return ttft, itl


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- one run -------------------------------------------------------------------------------------
def requests_for(model: Model, w: Workload, batch: int) -> list[Request]:
    config = model.source.config
    avoid = model.source.stop_ids | {config.bos_token_id if config.bos_token_id is not None else -1}
    return make_requests(w, w.num_prompts or batch, config.vocab_size, avoid, model.tokenizer)


def run_point(model: Model, opts: EngineOptions, batch: int, w: Workload, bandwidth_gbps: float,
              progress=None, hf=None, notice=lambda _: None) -> dict:
    """The figures for one batch size; with a shared prefix, the time to first token without the
    prefix cache too; with `hf` (a transformers model), its `generate` on the same requests."""
    result = run_batch(model, opts, batch, w, bandwidth_gbps, progress, notice)
    if w.prefix_len and opts.prefix_caching:
        plain = run_batch(model, replace(opts, prefix_caching=False), batch, w, bandwidth_gbps)
        result["ttft_ms_without_prefix_cache"] = plain["ttft_ms"]
    if hf is not None:
        from pagedcli.bench.hf import hf_generate

        base = hf_generate(hf, requests_for(model, w, batch), batch, model.device, w.ignore_eos)
        result["hf_output_tokens_per_s"] = base["output_tokens_per_s"]
        result["speedup_vs_hf"] = result["output_tokens_per_s"] / base["output_tokens_per_s"]
    return result


def run_batch(model: Model, opts: EngineOptions, batch: int, w: Workload, bandwidth_gbps: float,
              progress=None, notice=lambda _: None) -> dict:
    """Build an engine with `batch` slots, warm it up, run the workload, return the figures.
    `progress(done, total, step)`: after each step, the tokens generated of the most asked for."""
    engine = build_engine(model, replace(opts, batch=batch), notice)
    requests = requests_for(model, w, batch)
    check_lengths(requests, engine.cache.max_model_len, w)
    n = len(requests)
    asked = sum(r.max_tokens for r in requests)
    if progress is not None:
        progress(0, asked, 0)  # before the warm-up, which can take long too
    _warm_up(engine, requests[:batch])
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    weight_bytes = decode_weight_bytes(model)
    kv_per_token = engine.cache.geometry.kv_bytes_per_token

    _sync(device)
    arrivals = Arrivals(arrival_times(n, w.request_rate, w.seed))
    start = arrivals.begin()
    seqs = []

    def admit() -> None:
        """Hand the engine the requests that have arrived, each timed from its arrival."""
        for i in arrivals.due():
            r = requests[i]
            seqs.append(engine.add_request(r.prompt_token_ids, SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=w.ignore_eos, structured=w.structured)))
            seqs[-1].arrival_time = start + arrivals.times[i]

    prefill_s = decode_s = 0.0
    prefill_tokens = decode_tokens = 0
    decode_steps, decode_bytes, peak_blocks, peak_running, mixed_steps = 0, 0, 0, 0, 0
    num_finished, generated, steps = 0, 0, 0
    last = start
    while engine.has_unfinished or arrivals.pending:
        before = len(seqs)
        admit()
        num_finished += sum(s.is_finished for s in seqs[before:])  # a request that can never run ends at once
        if not engine.has_unfinished:  # nothing runs until the next arrival: not a step's time
            if arrivals.pending:
                arrivals.wait()
            last = time.perf_counter()
            continue
        out = engine.step()
        # a step's time is the wall clock since the last one returned: with the engine's overlap the
        # GPU goes on computing while this loop does its own work, so step() alone would leave that out
        now = time.perf_counter()
        period, last = now - last, now
        peak_blocks = max(peak_blocks, out.used_blocks)
        peak_running = max(peak_running, out.num_running)
        if out.is_prefill:  # its time is the prompts' (decode figures are over decode-only steps)
            prefill_s += period
            prefill_tokens += out.num_tokens - out.num_decode
            mixed_steps += out.num_decode > 0
        else:
            decode_s += period
            decode_tokens += len(out.seqs)
            decode_steps += 1
            decode_bytes += decode_step_bytes(weight_bytes, kv_per_token, [s.num_cached for s in out.seqs])
        generated += len(out.tokens)
        steps += 1
        if progress is not None:
            progress(generated, asked, steps)
    if progress is not None:  # done, though stop tokens may have ended answers before their --output-len
        progress(generated, generated, steps)
    _sync(device)
    elapsed = time.perf_counter() - start
    failed = [s for s in seqs if s.error]
    if failed:  # figures for fewer requests than asked would be mislabelled
        which = "every request" if len(failed) == n else f"{len(failed)} of {n} requests"
        raise RunError(f"{which} failed, the first: {failed[0].error}")

    geo = engine.cache.geometry
    output_tokens = sum(len(s.output_token_ids) for s in seqs)
    ttft, itl = latencies(seqs)
    step_ms = decode_s / decode_steps * 1e3 if decode_steps else None
    roofline_ms = decode_bytes / decode_steps / (bandwidth_gbps * 1e9) * 1e3 if decode_steps else None
    return {
        "batch": batch,
        "num_prompts": n,
        "input_len": w.input_len if w.prompt_file is None else "file",
        "output_len": w.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": n / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s else None,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "mixed_steps": mixed_steps,  # prefill steps that also carried decoding sequences' tokens
        "request_rate": None if math.isinf(w.request_rate) else w.request_rate,  # None: all at the start (JSON has no inf)
        "ttft_ms": summarize(ttft),
        "itl_ms": summarize(itl),
        "decode_step_ms": step_ms,
        "roofline_step_ms": roofline_ms,
        "achieved_gb_per_s": decode_bytes / decode_s / 1e9 if decode_s else None,
        "roofline_fraction": roofline_ms / step_ms if step_ms else None,
        "bandwidth_gb_per_s": bandwidth_gbps,
        "kv_blocks_total": geo.num_blocks,
        "kv_pool_bytes": geo.pool_bytes,
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "chunked_prefill": engine.scheduler.chunked_prefill,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "kv_blocks_peak": peak_blocks,
        "kv_bytes_peak": peak_blocks * geo.block_bytes,
        "kv_bytes_contiguous": peak_running * engine.cache.max_model_len * geo.kv_bytes_per_token,
        "preemptions": engine.scheduler.num_preemptions,
        "overlap": engine.overlap,
        "decode_steps_queued_ahead": engine.num_launched_ahead,
        "prefix_cache_hit_rate": engine.scheduler.prefix_hit_rate,
        "gpu_memory_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": opts.kv_cache_dtype,
        "quantization": opts.quantization,
        "weights": model.weights.format,  # the linear layers' format: bfloat16, fp8 (per channel), int4 (group 128, ...)
        "weight_bytes_per_step": weight_bytes,  # what the roofline counts: fp8 or 4-bit values as stored, plus scales
        "model": model.source.name,
        # (under tensor parallelism the pool's and the weights' bytes above are a rank's)
        "tensor_parallel_size": model.tp.world if model.tp is not None else 1,
    }


def check_lengths(requests: list[Request], max_model_len: int, w: Workload) -> None:
    """Refuse a workload the engine would cut short: figures for other lengths than those asked
    would be mislabelled."""
    longest = max(requests, key=lambda r: len(r.prompt_token_ids) + r.max_tokens)
    total = len(longest.prompt_token_ids) + longest.max_tokens
    if total > max_model_len:
        prompt = "a --prompt-file prompt" if w.prompt_file is not None else f"--input-len {w.input_len}"
        raise UsageError(f"{prompt} and --output-len {w.output_len} make requests of up to {plural(total, 'token')}, "
                         f"more than the maximum length of {max_model_len}",
                         "shorten them, or raise --max-model-len or --cache-size where the model allows")


def _warm_up(engine: Engine, requests: list) -> None:
    """Graphs captured, kernels compiled, allocator and cuBLAS warm: none of it in the timing."""
    engine.run_to_completion([r.prompt_token_ids for r in requests], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.runner.capture_graphs()
    engine.reset()  # the timed run must not count the warm-up, nor find its blocks
