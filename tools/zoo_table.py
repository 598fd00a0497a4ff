"""The preset table of docs/performance.md from `pagedcli bench --json` lines (tools/gpu_round.sh
ZOO=1): one row per preset, decode tokens/s and the fraction of the roofline at each batch."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows: dict[str, dict[int, dict]] = defaultdict(dict)
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                rows[r["model"].removeprefix("random:")][r["batch"]] = r
    batches = sorted({b for r in rows.values() for b in r})
    print("| preset | " + " | ".join(f"batch {b}: tokens/s, of roofline" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name, by_batch in rows.items():
        cells = [f"{by_batch[b]['decode_tokens_per_s']:,.0f}, {by_batch[b]['roofline_fraction']:.0%}"
                 if b in by_batch else "-" for b in batches]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
