"""Batch-1 decode on the GPU under variants of the CUDA backend's tunables, then a kernel profile.

    python3 tools/tune_decode.py [--output-len 256] [--profile-steps 32]

Each variant sets module constants of pagedcli.backends.cuda (or, with "overlap", the engine
option of that name), builds a fresh engine and times the workload `pagedcli bench` runs (random
Llama-3.2-1B weights, 128-token prompt): the step as the bench sees it, and its CUDA graph replayed
back to back (the GPU's part of it). Then each GEMM of a layer alone, ours against the cuBLAS path,
and the kernels of one decode step with their time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import replace

import torch

import pagedcli.backends.cuda as cuda_backend
from pagedcli.bench import Workload, measure_bandwidth, run_batch
from pagedcli.loader import EngineOptions, build_engine, load_model
from pagedcli.sequence import SamplingParams

VARIANTS = {
    "gemv (default)": {},
    "no overlap": {"overlap": False},  # an EngineOptions field: the engine waits for each step's tokens
    "no evict_first": {"GEMV_EVICT_FIRST": 0},
    "gemv: no split-K": {"GEMV_SPLITS": (1,)},  # one warp per row, whatever the row count
    "attention: no clusters": {"ATTN_CLUSTER": 1},
    "attention: cluster min span 32": {"CLUSTER_MIN_SPAN": 32},
    "attention: cluster min span 128": {"CLUSTER_MIN_SPAN": 128},
    "gemv: 512 threads, 2 CTAs per SM": {"GEMV_THREADS": 512, "GEMV_MIN_CTAS": 2, "GEMV_CTAS_PER_SM": 2},
    "gemv: 2 loads a lane (twice the tiles)": {"GEMV_UNROLL": 2},
}


@contextlib.contextmanager
def variant(settings: dict):
    saved = {k: getattr(cuda_backend, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(cuda_backend, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(cuda_backend, k, v)


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
    """An engine with graphs captured, `steps` steps into one 128-token request: the prefill and
    `steps - 1` decode steps."""
    engine = build_engine(model, opts)
    engine.runner.capture_graphs()
    seq = engine.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(steps):
        engine.step()
    return engine, seq


def replay_ms(model, opts, replays: int = 200) -> float:
    """GPU time of one batch-1 decode step: its CUDA graph replayed back to back (no host work
    between steps), at a context of ~200 tokens."""
    engine, _ = decoding_engine(model, opts, steps=72, max_tokens=80)
    return graph_ms(engine.runner.graphs.graph(1)[0], replays)


def gemv_table(model, opts) -> None:
    """Each GEMM of a layer at batch 1, alone: our fused GEMV against the cuBLAS path (our
    norm/silu kernels around torch.matmul), timed as kernel_bench times the attention kernel."""
    from pagedcli.backends.torch import TorchBackend
    from pagedcli.kernel_bench import time_ms

    engine = build_engine(model, opts)
    be, w = engine.runner.model.backend, engine.runner.model.w
    layers, dev, dtype = w.layers, model.device, model.dtype
    K, inter = layers[0].qkv.shape[1], layers[0].down.shape[1]
    x, attn = torch.randn(1, K, device=dev, dtype=dtype), torch.randn(1, layers[0].o.shape[1], device=dev, dtype=dtype)
    act = torch.randn(1, inter, device=dev, dtype=dtype)
    residual = torch.zeros(1, K, device=dev, dtype=dtype)
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

    print("\nGEMMs of a layer at batch 1, alone (us per call, GB/s of weights)")
    for name, (call, weight) in ops.items():
        nbytes = weight.numel() * weight.element_size()
        times = {"gemv": time_us(call, type(be)), "cublas": time_us(call, TorchBackend)}
        print(f"  {name:26s} {nbytes / 1e6:7.1f} MB  " + "  ".join(
            f"{k} {t:7.2f} us {nbytes / t / 1e3:6.0f} GB/s" for k, t in times.items()), flush=True)


def attention_table() -> None:
    """The decode-attention kernel alone at batch 1 (Llama-3.2-1B's heads) in an engine sized for
    long contexts, with and without clusters, under the cluster tunables (splits in brackets)."""
    from pagedcli.kernel_bench import bench_decode_kernel

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
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e.device_type, "name", "") == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"\nkernels of {steps} decode steps (batch 1, context ~{len(seq)}): "
          f"GPU busy {total / steps:.1f} us per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"  {e.self_device_time_total / steps:8.1f} us/step  {e.count // steps:4d}x  {e.key[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-len", default="256")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = ap.parse_args()
    opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", batch=1)
    model = load_model(opts)
    bandwidth = measure_bandwidth(model.device)
    work = Workload(input_len="128", output_len=args.output_len)
    for name, settings in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        settings = dict(settings)
        v_opts = replace(opts, overlap=settings.pop("overlap", opts.overlap))
        with variant(settings):
            r = run_batch(model, v_opts, 1, work, bandwidth)
            gpu_ms = replay_ms(model, v_opts)
        print(json.dumps({"variant": name, "decode_tokens_per_s": round(r["decode_tokens_per_s"], 1),
                          "decode_step_ms": round(r["decode_step_ms"], 4), "graph_replay_ms": round(gpu_ms, 4),
                          "roofline_fraction": round(r["roofline_fraction"], 3),
                          "achieved_gb_per_s": round(r["achieved_gb_per_s"], 1)}), flush=True)
    gemv_table(model, opts)
    attention_table()
    profile(model, opts, args.profile_steps)


if __name__ == "__main__":
    main()
