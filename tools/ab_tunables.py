"""A/B of the CUDA backend's tunables on one model, in one run: `pagedcli bench`'s figures for the
defaults and for each variant, alternating, `--rounds` times (these machines drift between runs,
so only figures from one run are compared).

    python3 tools/ab_tunables.py --model random:tinyllama-1.1b --batch 1,16 --set MAX_HEADS_PER_CTA=4
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tune_decode import variant  # noqa: E402  (the tunables set where they are read)

from pagedcli.bench.bandwidth import measure_bandwidth  # noqa: E402
from pagedcli.bench.measure import Workload, run_batch  # noqa: E402
from pagedcli.engine.build import load_model
from pagedcli.core.options import EngineOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE[,NAME=VALUE]: one variant")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    variants = {"default": {}}
    for spec in args.set:
        variants[spec] = {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    batches = [int(b) for b in args.batch.split(",")]
    model = load_model(EngineOptions(model=args.model, device="cuda", batch=max(batches)))
    bandwidth = measure_bandwidth(model.device)
    work = Workload(input_len=args.input_len, output_len=args.output_len)
    for r in range(args.rounds):
        for name, settings in variants.items():
            for b in batches:
                with variant(settings):
                    res = run_batch(model, EngineOptions(model=args.model, device="cuda", batch=b), b, work, bandwidth)
                print(json.dumps({"round": r, "variant": name, "batch": b,
                                  "decode_tokens_per_s": round(res["decode_tokens_per_s"], 1),
                                  "roofline_fraction": round(res["roofline_fraction"], 3)}), flush=True)


if __name__ == "__main__":
    main()
