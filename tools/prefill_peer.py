"""Time to first token of long prompts on the GPU: pagedcli's prefill against transformers' forward
pass (sdpa) on the same random weights, in one process, one run.

    python3 tools/prefill_peer.py [--model random:llama-3.2-1b] [--lens 16000 16x4000] [--repeats 3]

A length `N` is one prompt of N tokens; `KxN` is K prompts of N tokens submitted together (the
time is until the last of them has its first token). pagedcli runs with the prefix cache off (a
repeat would otherwise hit its own blocks) and its default step budget (a prompt over it is
prefilled in chunks, over several steps); transformers runs one
padded-free forward per prompt batch (`logits_to_keep=1`: only the last position's logits, as
pagedcli computes).
"""

from __future__ import annotations

import argparse
import time

import torch

import pagedcli.backends.cuda_build as cuda_build
from pagedcli.bench.hf import hf_model
from pagedcli.core.options import SamplingParams
from pagedcli.engine.build import build_engine, load_model
from pagedcli.core.options import EngineOptions


def parse(spec: str) -> tuple[int, int]:
    count, _, n = spec.rpartition("x")
    return (int(count) if count else 1), int(n)


def best_ms(run, repeats: int) -> float:
    run()  # warm-up: compile, allocate, capture
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--lens", nargs="*", default=["16000", "16x4000"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="then the kernels of one pagedcli prefill of each length")
    ap.add_argument("--torch-prefill", action="store_true",
                    help="also time pagedcli with its prefill attention as torch ops (gather + SDPA), the path before "
                         "kernels/paged_prefill.cu")
    ap.add_argument("--no-cudnn", action="store_true",
                    help="also time pagedcli with every prompt in kernels/paged_prefill.cu (no whole prompts through cuDNN)")
    ap.add_argument("--m-tiles", type=int, nargs="*", default=[cuda_build.PREFILL_M_TILES_SMALL_D],
                    help="16-row tiles a prefill warp computes at head_dim <= 64 (each value: an engine of its own)")
    ap.add_argument("--block-n", type=int, nargs="*", default=[cuda_build.PREFILL_BLOCK_N],
                    help="keys per prefill tile (with each --m-tiles value: an engine of its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step budget (default: the engine's)")
    ap.add_argument("--quantization", default="none", help="pagedcli's weights: none, or fp8 (transformers stays bf16)")
    args = ap.parse_args()
    specs = [parse(s) for s in args.lens]
    longest = max(n for _, n in specs)
    most = max(k for k, _ in specs)
    opts = EngineOptions(model=args.model, device="cuda", batch=most, prefix_caching=False,
                         max_model_len=longest + 16, max_num_batched_tokens=args.max_num_batched_tokens,
                         quantization=args.quantization)
    model = load_model(opts)
    engines = {}
    for m in args.m_tiles:  # the plan reads the constants when the backend is built
        for n in args.block_n:
            cuda_build.PREFILL_M_TILES_SMALL_D, cuda_build.PREFILL_BLOCK_N = m, n
            engines[m, n] = build_engine(model, opts)
    print(f"step budget {next(iter(engines.values())).scheduler.max_num_batched_tokens} tokens", flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.source.config.vocab_size
    hf = None if args.no_hf else hf_model(model)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for count, n in specs:
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in range(count)]
        line = f"{count} x {n} tokens:"
        for (m, n_keys), engine in engines.items():
            def ours(engine=engine):
                engine.reset()
                for p in prompts:
                    engine.add_request(p, params)
                while engine.has_unfinished:
                    engine.step()

            line += f"   pagedcli (m-tiles {m}, {n_keys} keys) {best_ms(ours, args.repeats):7.1f} ms"
        backend = engine.runner.model.backend
        if args.torch_prefill and getattr(backend, "prefill_kernel", False):
            backend.prefill_kernel = False
            line += f"   torch prefill attention {best_ms(ours, args.repeats):7.1f} ms"
            backend.prefill_kernel = True
        if args.no_cudnn and getattr(backend, "cudnn_prefill", False):
            backend.cudnn_prefill = False
            line += f"   all in paged_prefill.cu {best_ms(ours, args.repeats):7.1f} ms"
            backend.cudnn_prefill = True
        if hf is not None:
            ids = torch.tensor(prompts, device=model.device)

            def theirs():
                with torch.no_grad():
                    hf(ids, logits_to_keep=1)

            line += f"   transformers (sdpa) {best_ms(theirs, args.repeats):7.1f} ms"
        print(line, flush=True)
        if args.profile:
            profile(ours)


def profile(run) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True,
                       with_stack=True) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e.device_type, "name", "") == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"  kernels: {total / 1e3:.1f} ms in all")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:4d}x  {e.key[:90]}")
    gaps(prof)


def gaps(prof, shown: int = 8) -> None:
    """Where the GPU idles within the run: the longest gaps between kernels (and copies), each with
    the host's Python frames that ran during it (the profiler's trace)."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    device = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not device:
        return
    idle = []
    end = device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        if e["ts"] > end:
            idle.append((e["ts"] - end, end, e["ts"], e["name"][:50]))
        end = max(end, e["ts"] + e["dur"])
    span = end - device[0]["ts"]
    print(f"  GPU span {span / 1e3:.1f} ms, idle {sum(g[0] for g in idle) / 1e3:.1f} ms in {len(idle)} gaps")
    frames = [e for e in trace if e.get("cat") == "python_function" and e.get("dur", 0) > 0]
    for length, start, stop, after in sorted(idle, reverse=True)[:shown]:
        inside = [e for e in frames if e["ts"] < stop and e["ts"] + e["dur"] > start]
        # our frames that cover at least half of the gap, innermost (shortest) first
        ours = sorted((e for e in inside if "pagedcli" in e["name"]
                       and min(stop, e["ts"] + e["dur"]) - max(start, e["ts"]) >= length / 2), key=lambda e: e["dur"])
        names = ", ".join(dict.fromkeys(e["name"].split("/")[-1][:60] for e in ours[:12]))
        print(f"  {length / 1e3:7.2f} ms idle before {after}: {names}")


if __name__ == "__main__":
    main()
