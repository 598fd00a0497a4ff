"""Batch-1 decode on the GPU under variants of the CUDA backend's tunables, then a kernel profile.

    python3 tools/tune_decode.py [--output-len 256] [--profile-steps 32]

Each variant sets module constants of pagedcli.backends.cuda_build, cuda_launch and cuda (or, with
"overlap", the engine option of that name), builds a fresh engine and times the workload `pagedcli bench` runs (random
Llama-3.2-1B weights, 128-token prompt): the step as the bench sees it, and its CUDA graph replayed
back to back (the GPU's part of it). Then each GEMM of a layer alone, ours against the cuBLAS path
and against a kernel that only reads its weights (tools/read_floor.cu), attention alone, and the
kernels of decode steps: their time, and the idle time between them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from dataclasses import replace

import torch

import pagedcli.backends.cuda as cuda_backend
import pagedcli.backends.cuda_build as cuda_build
import pagedcli.backends.cuda_gemv as cuda_gemv
import pagedcli.backends.cuda_launch as cuda_launch
from pagedcli.bench.bandwidth import measure_bandwidth
from pagedcli.bench.measure import Workload, run_batch
from pagedcli.engine.build import build_engine, load_model
from pagedcli.core.options import EngineOptions
from pagedcli.core.options import SamplingParams

VARIANTS = {
    "gemv (default)": {},
    "no overlap": {"overlap": False},  # an EngineOptions field: the engine waits for each step's tokens
    "no evict_first": {"GEMV_EVICT_FIRST": 0},
    "no programmatic launch": {"PROGRAMMATIC_LAUNCH": False},  # every kernel waits for the previous one's end
    "gemv: no split-K": {"GEMV_SPLITS": (1,)},  # one warp per row, whatever the row count
    "attention: no clusters": {"ATTN_CLUSTER": 1},
    "attention: cluster min span 32": {"CLUSTER_MIN_SPAN": 32},
    "attention: cluster min span 128": {"CLUSTER_MIN_SPAN": 128},
    "gemv: 512 threads, 2 CTAs per SM": {"GEMV_THREADS": 512, "GEMV_MIN_CTAS": 2, "GEMV_CTAS_PER_SM": 2},
    "gemv: 2 loads a lane (twice the tiles)": {"GEMV_UNROLL": 2},
    # how many splits a large batch's short contexts get (batch 64 has 1 at 4 CTAs an SM)
    "attention: splits up to 8 CTAs an SM": {"SPLIT_CTAS_PER_SM": 8},
    "attention: splits up to 16 CTAs an SM": {"SPLIT_CTAS_PER_SM": 16},
    "attention: 16 CTAs an SM, min span 64": {"SPLIT_CTAS_PER_SM": 16, "MIN_SPAN": 64},
    # more decode CTAs resident an SM (shared memory allows 5 by default): a smaller ring or scores
    "attention: 3 ring stages, 6 CTAs an SM": {"ATTN_STAGES": 3, "MIN_CTAS_SMALL_Q": 6},
    "attention: 256-token chunks, 6 CTAs an SM": {"PARTITION_SIZE": 256, "MIN_CTAS_SMALL_Q": 6},
    # decode attention where one CTA per (sequence, kv head) fills the GPU: paged_decode_mma.cu's tiles
    "attention: no tensor cores": {"DECODE_MMA_KERNEL": False},
    "attention mma: 32 keys a tile": {"DECODE_MMA_KEYS": 32},
    "attention mma: 3 stages": {"DECODE_MMA_STAGES": 3},
    "attention mma: 8 warps": {"DECODE_MMA_WARPS": 8},
    "attention mma: 2 warps": {"DECODE_MMA_WARPS": 2},
    "attention mma: 2 warps, 3 stages": {"DECODE_MMA_WARPS": 2, "DECODE_MMA_STAGES": 3},
    "attention mma: 1 warp, 4 stages": {"DECODE_MMA_WARPS": 1, "DECODE_MMA_STAGES": 4},
    # rope_write_kv past gemv.cu's rows: CTAs a token (its items over the threads of a CTA)
    "rope: 64 threads a CTA": {"KV_WRITE_THREADS": 64},
    "rope: 32 threads a CTA": {"KV_WRITE_THREADS": 32},
}


def variant_opts(opts, name: str, batch: int) -> tuple:
    """A variant's engine options at `batch` (its "overlap" is one of them) and the module constants
    it sets."""
    settings = dict(VARIANTS[name])
    return replace(opts, overlap=settings.pop("overlap", opts.overlap), batch=batch), settings


@contextlib.contextmanager
def variant(settings: dict):
    """The tunables set in every module that reads them: cuda_build (what is compiled), cuda_launch,
    cuda and cuda_gemv (how it is launched)."""
    saved = {(m, k): getattr(m, k) for m in (cuda_build, cuda_launch, cuda_backend, cuda_gemv) for k in settings
             if hasattr(m, k)}
    try:
        for (m, k) in saved:
            setattr(m, k, settings[k])
        yield
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)


def graph_ms(graph, replays: int) -> float:
    """Milliseconds per replay of a captured CUDA graph, replayed back to back after a warm-up."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def decoding_engine(model, opts, steps: int, max_tokens: int):
    """An engine with graphs captured, `steps` steps into `opts.batch` 128-token requests: the
    prefill and `steps - 1` decode steps."""
    engine = build_engine(model, opts)
    engine.runner.capture_graphs()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(list(range(1000 + i, 1128 + i)), params) for i in range(opts.batch)]
    for _ in range(steps):
        engine.step()
    return engine, seqs[0]


def replay_ms(model, opts, replays: int = 200) -> float:
    """GPU time of one decode step at the options' batch: its CUDA graph replayed back to back (no
    host work between steps), at a context of ~200 tokens."""
    engine, _ = decoding_engine(model, opts, steps=72, max_tokens=80)
    return graph_ms(engine.runner.graphs.graph(opts.batch)[0], replays)


def gemv_table(model, opts, rows: int = 1) -> None:
    """Each GEMM of a layer at a batch of `rows`, alone: ours (gemv.cu at 1 and 2 rows; the cuBLAS
    path beyond) against the cuBLAS path (our norm/silu kernels around torch.matmul), timed as
    kernel_bench times the attention kernel."""
    from pagedcli.backends.torch import TorchBackend
    from pagedcli.bench.kernel import time_ms

    engine = build_engine(model, opts)
    be, w = engine.runner.model.backend, engine.runner.model.w
    layers, dev, dtype = w.layers, model.device, model.dtype
    K, inter = layers[0].qkv.shape[1], layers[0].down.shape[1]
    x = torch.randn(rows, K, device=dev, dtype=dtype)
    attn = torch.randn(rows, layers[0].o.shape[1], device=dev, dtype=dtype)
    act = torch.randn(rows, inter, device=dev, dtype=dtype)
    residual = torch.zeros(rows, K, device=dev, dtype=dtype)
    # call i uses layer i's weights: every layer's copy together is larger than L2, as in a real step
    ops = {
        "qkv (rms_norm)": (lambda impl, i: impl.norm_linear(be, x, layers[i].input_norm, layers[i].qkv, 1e-5),
                           layers[0].qkv),
        "o (+residual)": (lambda impl, i: impl.linear_add(be, attn, layers[i].o, residual), layers[0].o),
        "gate_up (rms_norm, silu_mul)": (
            lambda impl, i: impl.norm_linear_silu(be, x, layers[i].post_norm, layers[i].gate_up, 1e-5),
            layers[0].gate_up),
        "down (+residual)": (lambda impl, i: impl.linear_add(be, act, layers[i].down, residual), layers[0].down),
        "lm_head (rms_norm, float)": (lambda impl, i: impl.logits(be, x, w.norm, w.lm_head, 1e-5), w.lm_head),
    }

    def time_us(call, impl) -> float:
        return time_ms([lambda i=i: call(impl, i) for i in range(len(layers))]) * 1e3

    print(f"\nGEMMs of a layer at batch {rows}, alone (us per call, GB/s of weights)")
    for name, (call, weight) in ops.items():
        nbytes = weight.nbytes  # (an fp8 weight's: a byte a value plus its scales)
        times = {"ours": time_us(call, type(be)), "cublas": time_us(call, TorchBackend)}
        print(f"  {name:26s} {nbytes / 1e6:7.1f} MB  " + "  ".join(
            f"{k} {t:7.2f} us {nbytes / t / 1e3:6.0f} GB/s" for k, t in times.items()), flush=True)


def read_floor_table(model) -> None:
    """tools/read_floor.cu at each GEMM's weight size: the time a kernel takes that only reads those
    bytes, beside ours (gemv_table), and the step a decode of one such kernel per GEMM would take."""
    from pathlib import Path

    import cupy

    from pagedcli.bench.kernel import time_ms

    w = model.weights
    sizes = {name: t.nbytes for name, t in (
        ("qkv", w.layers[0].qkv), ("o", w.layers[0].o), ("gate_up", w.layers[0].gate_up),
        ("down", w.layers[0].down), ("lm_head", w.lm_head))}
    source = (Path(__file__).parent / "read_floor.cu").read_text()
    threads = cuda_build.GEMV_THREADS  # gemv.cu's grid: one wave of GEMV_CTAS_PER_SM CTAs an SM
    options = ("-std=c++17", f"-DGEMV_THREADS={threads}", f"-DREAD_UNROLL={2 * cuda_build.GEMV_UNROLL}")
    kernel = cupy.RawModule(code=source, options=options).get_function("read_all")
    grid = cuda_build.GEMV_CTAS_PER_SM * torch.cuda.get_device_properties(model.device).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device=model.device)

    def launch(buffer: torch.Tensor) -> None:
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older ones lack the successor
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            kernel((grid,), (threads,), (buffer.data_ptr(), cupy.int64(buffer.numel() // 16), sink.data_ptr()))

    print("\nread floor: a kernel that only reads the bytes, back to back in a graph (us, GB/s)")
    floor = {}
    for name, nbytes in {"empty": 16, **sizes}.items():
        copies = [torch.empty(nbytes, dtype=torch.uint8, device=model.device) for _ in range(2 if nbytes > 2**27 else 16)]
        floor[name] = time_ms([lambda b=b: launch(b) for b in copies]) * 1e3
        print(f"  {name:8s} {nbytes / 1e6:7.1f} MB  {floor[name]:7.2f} us  {nbytes / floor[name] / 1e3:6.0f} GB/s", flush=True)
        del copies
    layers = len(w.layers)
    step = layers * sum(floor[k] for k in ("qkv", "o", "gate_up", "down")) + floor["lm_head"]
    print(f"  one kernel per GEMM at this floor: {step:.0f} us a step for the GEMMs alone")


def attention_table() -> None:
    """The decode-attention kernel alone at batch 1 (Llama-3.2-1B's heads) in an engine sized for
    long contexts, with and without clusters, under the cluster tunables (splits in brackets)."""
    from pagedcli.bench.kernel import bench_decode_kernel

    contexts = [128, 256, 512, 1024, 2048, 4096, 8192]
    print("\nattention alone, batch 1, max_model_len 131072 (us per call) at contexts " + ", ".join(map(str, contexts)))
    for cluster, min_span in ((1, 64), (8, 32), (8, 64), (8, 128)):
        with variant({"ATTN_CLUSTER": cluster, "CLUSTER_MIN_SPAN": min_span}):
            rows = bench_decode_kernel([1], contexts, max_model_len=131072)
        print(f"  cluster {cluster}, min span {min_span:3d}: " + "  ".join(
            f"{r['paged_ms'] * 1e3:6.2f} ({r['splits']})" for r in rows), flush=True)


def profile(model, opts, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine, seq = decoding_engine(model, opts, steps=20, max_tokens=steps + 40)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e.device_type, "name", "") == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"\nkernels of {steps} decode steps (batch {opts.batch}, context ~{len(seq)}): "
          f"GPU busy {total / steps:.1f} us per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"  {e.self_device_time_total / steps:8.1f} us/step  {e.count // steps:4d}x  {e.key[:90]}")
    timeline(prof)


def timeline(prof) -> None:
    """The kernels of the profiled steps in time order (the profiler's trace): for each kernel of a
    step, its mean time from start to end and the mean idle time before it (the end of the kernel
    before to its start: launch, and waiting for the one before to be done)."""
    import os
    import tempfile
    from collections import defaultdict

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps, step = [], []
    for e in kernels:  # a step ends with its greedy argmax
        step.append(e)
        if e["name"].startswith("argmax"):
            steps.append(step)
            step = []
    steps = steps[1:]  # the first may have begun before the profiler
    if not steps:
        return
    per_kernel = defaultdict(lambda: [0.0, 0.0, 0])  # name -> [time, idle before, count]
    spans, busy = [], []
    for step in steps:
        for before, e in zip([None] + step[:-1], step):
            k = per_kernel[e["name"][:60]]
            k[0] += e["dur"]
            k[1] += 0.0 if before is None else max(0.0, e["ts"] - (before["ts"] + before["dur"]))
            k[2] += 1
        spans.append(step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"])
        busy.append(sum(e["dur"] for e in step))
    n = len(steps)
    print(f"\ntimeline of {n} steps: first kernel's start to last kernel's end {sum(spans) / n:.1f} us, "
          f"kernels running {sum(busy) / n:.1f} us, idle between them {(sum(spans) - sum(busy)) / n:.1f} us")
    print("  per step: kernel, count, us running (each), us idle before it (each)")
    for name, (dur, idle, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:60s} {count // n:4d}x  {dur / count:7.2f}  {idle / count:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-len", default="256")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    ap.add_argument("--profile-variants", nargs="*", default=["gemv (default)"], help="the variants to profile")
    ap.add_argument("--no-tables", action="store_true", help="no GEMM and attention tables")
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--quantization", default="none", help="none or fp8 (the weights)")
    ap.add_argument("--batch", type=int, default=1, help="the profile's batch")
    ap.add_argument("--variant-batch", type=int, default=1, help="the batch the variants run")
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[1], help="the GEMM table's batches")
    args = ap.parse_args()
    opts = EngineOptions(model=args.model, device="cuda", batch=1, quantization=args.quantization)
    model = load_model(opts)
    bandwidth = measure_bandwidth(model.device)
    work = Workload(input_len="128", output_len=args.output_len)
    for name in VARIANTS:
        if args.only and name not in args.only:
            continue
        v_opts, settings = variant_opts(opts, name, args.variant_batch)
        with variant(settings):
            r = run_batch(model, v_opts, args.variant_batch, work, bandwidth)
            gpu_ms = replay_ms(model, v_opts)
        print(json.dumps({"variant": name, "decode_tokens_per_s": round(r["decode_tokens_per_s"], 1),
                          "decode_step_ms": round(r["decode_step_ms"], 4), "graph_replay_ms": round(gpu_ms, 4),
                          "roofline_fraction": round(r["roofline_fraction"], 3),
                          "achieved_gb_per_s": round(r["achieved_gb_per_s"], 1)}), flush=True)
    if not args.no_tables:
        for rows in args.gemm_rows:
            gemv_table(model, opts, rows)
        read_floor_table(model)
        attention_table()
    for name in args.profile_variants:
        if name not in VARIANTS:
            raise SystemExit(f"--profile-variants: no variant {name!r} (there are: {', '.join(VARIANTS)})")
        print(f"\n--- profile: {name}")
        p_opts, settings = variant_opts(opts, name, args.batch)
        with variant(settings):
            profile(model, p_opts, args.profile_steps)


if __name__ == "__main__":
    main()
