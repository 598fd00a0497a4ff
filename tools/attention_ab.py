"""The decode attention kernel alone and the decode step's graph replay: another revision's kernels
against this tree's, alternating in one process (one machine, one run).

    git archive REV kernels | tar -x -C /tmp/base && python3 tools/attention_ab.py /tmp/base/kernels

(the folder is `kernels` in revisions before the CUDA source moved to kernels/). A revision without
paged_decode_mma.cu runs the split-KV kernel at every batch.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pagedcli.backends.cuda_build as cuda_build
import pagedcli.backends.cuda_compile as cuda_compile
from pagedcli.bench.kernel import bench_decode_kernel
from pagedcli.engine.build import load_model
from pagedcli.core.options import EngineOptions
from tune_decode import replay_ms  # (tools/ is the script's folder, so on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path, help="the other revision's kernels/ (or kernels/) folder")
    args = ap.parse_args()
    folders = {"base": args.base.resolve(), "tree": cuda_compile.kernel_folder()}
    opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", batch=1)
    model = load_model(opts)
    for round_ in range(2):
        for name in ("base", "tree") if round_ == 0 else ("tree", "base"):
            cuda_compile.kernel_folder = lambda folder=folders[name]: folder  # what kernel_source reads
            cuda_compile.compile_kernels.cache_clear()
            cuda_build.DECODE_MMA_KERNEL = (folders[name] / "paged_decode_mma.cu").is_file()
            rows = bench_decode_kernel([1, 64, 256], [164, 1024, 4096], max_model_len=131072)
            print(f"{round_} {name:4s} attention alone, us:", "  ".join(
                f"b{r['batch']}/{r['context']} {r['paged_ms'] * 1e3:6.2f}" for r in rows), flush=True)
            steps = {b: replay_ms(model, replace(opts, batch=b)) for b in (1, 64, 256)}
            print(f"{round_} {name:4s} decode step, ms:", "  ".join(f"b{b} {t:.4f}" for b, t in steps.items()),
                  flush=True)


if __name__ == "__main__":
    main()
