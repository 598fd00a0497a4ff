#!/usr/bin/env python
"""A bounded load test of an OpenAI-compatible server (`pagedcli serve`): N streamed completions
arriving at a rate (a seeded Poisson process), at most --concurrency open at once; it reports TTFT
and ITL mean/p50/p99, tokens/s and the errors, and exits 1 when more than --max-errors failed.

    python tools/load_test.py --url http://127.0.0.1:8000 --requests 200 --rate 8 --concurrency 32

The requests and the timing are `pagedcli bench --url`'s (pagedcli/bench/served.py), one batch size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pagedcli of this checkout, installed or not
from pagedcli.bench import served  # noqa: E402
from pagedcli.bench.measure import Workload  # noqa: E402
from pagedcli.core.errors import PagedCliError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=100, help="requests in all (default 100)")
    p.add_argument("--rate", type=float, default=math.inf, help="requests a second (default: all at the start)")
    p.add_argument("--concurrency", type=int, default=32, help="streams open at once at most (default 32)")
    p.add_argument("--input-len", default="128", help="prompt tokens, or a range 100:1024 (default 128)")
    p.add_argument("--output-len", default="128", help="new tokens, or a range (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="the model the prompts are drawn for (default: the server's)")
    p.add_argument("--api-key")
    p.add_argument("--max-errors", type=int, default=0, help="exit 1 when more requests fail (default 0)")
    p.add_argument("--json", action="store_true", help="the figures as one JSON object")
    a = p.parse_args(argv)
    if a.requests < 1 or a.concurrency < 1 or not a.rate > 0:
        p.error("--requests and --concurrency must be at least 1, --rate positive")
    w = Workload(num_prompts=a.requests, input_len=a.input_len, output_len=a.output_len, seed=a.seed,
                 request_rate=a.rate)
    say = lambda text: print(text, file=sys.stderr)  # noqa: E731
    try:
        [r] = served.run(a.url, a.api_key, [a.concurrency], w, a.model, notice=say)
    except PagedCliError as e:
        say(f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    if a.json:
        print(json.dumps(r))
    else:
        rate = "all at the start" if r["request_rate"] is None else f"{r['request_rate']:g}/s"
        print(f"{r['num_prompts']} requests to {r['model']} at {r['url']}, {rate}, {min(a.concurrency, r['num_prompts'])} at once: "
              f"{r['elapsed_s']:.1f} s, {r['output_tokens_per_s']:,.0f} tokens/s, {r['requests_per_s']:.2f} requests/s, "
              f"{r['errors']} errors")
        for name in ("ttft_ms", "itl_ms"):
            s = r[name]
            print(f"  {name.removesuffix('_ms').upper():4} ms  " + "  ".join(
                f"{k} {'-' if s[k] is None else format(s[k], '.2f')}" for k in ("mean", "p50", "p99")))
    return 1 if r["errors"] > a.max_errors else 0


if __name__ == "__main__":
    sys.exit(main())
