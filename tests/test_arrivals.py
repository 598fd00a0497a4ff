"""bench --request-rate: Poisson arrivals, seeded; requests reach the engine only once they have
arrived; TTFT and ITL from a known timeline."""

from __future__ import annotations

import json
import math
import statistics
from types import SimpleNamespace

import pytest

from helpers import invoke
from pagedcli.bench.arrivals import Arrivals, arrival_times
from pagedcli.bench.measure import latencies, summarize


def test_arrivals_are_seeded_and_exponential():
    times = arrival_times(4000, rate=20.0, seed=3)
    assert times == arrival_times(4000, rate=20.0, seed=3)
    assert times != arrival_times(4000, rate=20.0, seed=4)
    assert times[0] == 0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)  # mean 1/rate; sd of the mean ~1.6%
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.08)  # an exponential's sd is its mean
    assert sum(g < math.log(2) / 20 for g in gaps) / len(gaps) == pytest.approx(0.5, abs=0.03)  # its median
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_nothing_is_handed_out_before_it_arrives():
    now = [100.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    arrivals = Arrivals([0.0, 0.5, 0.5, 2.0], clock=lambda: now[0], sleep=sleep)
    arrivals.begin()
    assert list(arrivals.due()) == [0]
    now[0] = 100.49
    assert list(arrivals.due()) == []
    now[0] = 100.5
    assert list(arrivals.due()) == [1, 2] and arrivals.pending
    arrivals.wait()  # nothing runs: sleep until request 3 arrives
    assert slept == [pytest.approx(1.5)] and list(arrivals.due()) == [3]
    assert not arrivals.pending


def test_ttft_and_itl_from_a_known_timeline():
    # request i arrives at i, gets its first token (i + 1) x 10 ms later, then tokens 1, 2, 3 ms apart
    seqs = [SimpleNamespace(arrival_time=float(i), first_token_time=i + (i + 1) / 100,
                            token_times=[i + (i + 1) / 100 + t / 1000 for t in (0, 1, 3, 6)]) for i in range(100)]
    seqs.append(SimpleNamespace(arrival_time=5.0, first_token_time=None, token_times=[]))  # never ran
    ttft, itl = latencies(seqs)
    t = summarize(ttft)
    assert t["mean"] == pytest.approx(505) and t["p50"] == pytest.approx(505) and t["p99"] == pytest.approx(990)
    i = summarize(itl)
    assert i["mean"] == pytest.approx(2) and i["p50"] == pytest.approx(2) and i["p99"] == pytest.approx(3)


def test_bench_under_arrivals(stories):
    """Every request is timed from its own arrival: with 8 requests a second over about a second,
    no TTFT comes near the run's length, and the figures say how requests came."""
    code, stdout, err = invoke("bench", "--model", str(stories), "--json", "--batch", "2", "--num-prompts", "8",
                               "--input-len", "30:120", "--output-len", "6", "--request-rate", "8",
                               "--max-num-batched-tokens", "16", "--bandwidth", "10")
    assert code == 0, err
    row = json.loads(stdout)
    assert row["request_rate"] == 8 and row["chunked_prefill"] and row["max_num_batched_tokens"] == 16
    code, stdout, _ = invoke("bench", "--model", str(stories), "--json", "--batch", "2", "--output-len", "2",
                             "--bandwidth", "10")
    assert code == 0 and json.loads(stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["request_rate"] is None
    assert row["elapsed_s"] > arrival_times(8, 8.0, seed=0)[-1], "the run lasts until the last arrival at least"
    assert row["ttft_ms"]["p99"] < 1e3 * row["elapsed_s"] / 2


def test_request_rate_must_be_positive(stories):
    code, _, err = invoke("bench", "--model", str(stories), "--request-rate", "0")
    assert code == 2 and "--request-rate 0.0: must be a positive number" in err
