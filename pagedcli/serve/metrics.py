"""GET /metrics: Prometheus' text format, with vLLM's metric names where vLLM has one (so its
dashboards work) and pagedcli's own for the rest (the pool's blocks, the hit rate, tokens/s).

Counted where the numbers are: the engine's process tallies each turn's (Tally: the gauges, the
tokens handed out, the latencies observed) into a StepReport, which its message carries; the API
process adds the reports up (Metrics) and renders the text. Written out here, not with
prometheus_client, which the server does not need (the tests parse the text with it)."""

from __future__ import annotations

import bisect
import time
from array import array
from collections import deque
from typing import NamedTuple

from pagedcli.core.errors import plural

# vLLM's buckets (its v1 metrics), with finer ones below 10 ms for inter-token latency on a GPU
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
RATE_WINDOW_S = 10.0  # tokens/s over the last this many seconds
FINISH_REASONS = ("stop", "length", "error")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def observe_all(self, values) -> None:
        """Each of `values` (a step's inter-token latencies: one per running answer)."""
        counts, buckets = self.counts, self.buckets
        for value in values:
            counts[bisect.bisect_left(buckets, value)] += 1
        self.sum += sum(values)

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.buckets, self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        total += self.counts[-1]
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {total}', f"{name}_sum{{{labels}}} {self.sum}",
                f"{name}_count{{{labels}}} {total}"]
        return out


class StepReport(NamedTuple):
    """One message's numbers: the engine's state after the turn, and what happened in it."""

    num_steps: int  # steps run in the turn (0 or 1)
    now: float  # perf_counter, when it was taken
    num_taken: int  # answers the engine has taken out of the pipe so far
    waiting: int  # answers waiting for a slot in the engine (parallel samples waiting for their prompt too)
    free_slots: int
    running: int
    used_blocks: int
    prompt_tokens: int  # admitted, recomputations included
    cached_prompt_tokens: int  # of those, served from cached prefix blocks
    preemptions: int
    generated: int  # tokens handed out in the turn
    ttfts: list[float]  # seconds, one per answer that got its first token
    itls: array  # seconds between an answer's last two tokens, one per other answer that got tokens ('d')
    finished: list[tuple[str, float]]  # (finish reason, seconds since arrival), one per answer that ended
    aborted: int  # answers aborted in the turn


class Tally:
    """The engine process's side: what a turn did, until the next report."""

    def __init__(self):
        self._clear()

    def _clear(self) -> None:
        self.num_steps = self.generated = self.num_aborted = 0
        self.ttfts, self.itls, self.finishes = [], array("d"), []
        self.now = None

    def tokens(self, seq, n: int, first: bool) -> None:
        """`n` new tokens of `seq` handed out (`first`: its first ones)."""
        if not n:
            return
        self.generated += n
        if first:
            self.ttfts.append(seq.first_token_time - seq.arrival_time)
        elif len(seq.token_times) > 1:
            self.itls.append(seq.token_times[-1] - seq.token_times[-2])

    def next_token(self, seq) -> None:
        """One token of `seq`'s handed out, not its first: a decode step's, the common case."""
        self.generated += 1
        times = seq.token_times
        if len(times) > 1:
            self.itls.append(times[-1] - times[-2])

    def finished(self, seq, now: float) -> None:
        self.finishes.append((seq.finish_reason, now - seq.arrival_time))

    def aborted(self, n: int) -> None:
        self.num_aborted += n

    def stepped(self, now: float) -> None:
        self.num_steps += 1
        self.now = now

    def report(self, engine) -> StepReport:
        """The turn's numbers, the engine's now; num_taken is each link's own (engine_process._send)."""
        sched, cache = engine.scheduler, engine.cache
        waiting = len(sched.waiting) + sum(len(c) for c in sched.forks.values())
        report = StepReport(
            self.num_steps, self.now or time.perf_counter(), 0, waiting,
            max(0, cache.max_slots - len(sched.running)), len(sched.running),
            cache.geometry.num_blocks - cache.num_free_blocks, sched.prompt_tokens, sched.cached_prompt_tokens,
            sched.num_preemptions, self.generated, self.ttfts, self.itls, self.finishes, self.num_aborted)
        self._clear()
        return report


class Metrics:
    """The API process's side: the reports added up, rendered on request."""

    def __init__(self):
        self.labels = ""  # model_name="...", once the model is known
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)
        self.generation_tokens = 0
        self.finished_by = dict.fromkeys(FINISH_REASONS, 0)
        self.num_aborted = 0
        # the engine's, as of its last report
        self.running = self.waiting = self.used_blocks = self.num_steps = 0
        self.total_blocks = 1
        self.prompt_tokens = self.cached_prompt_tokens = self.preemptions = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, generation tokens so far), one per step

    def describe(self, model_name: str, num_blocks: int) -> None:
        self.labels = 'model_name="{}"'.format(model_name.replace("\\", "\\\\").replace('"', '\\"'))
        self.total_blocks = num_blocks

    def record(self, r: StepReport) -> None:
        self.running, self.waiting, self.used_blocks = r.running, r.waiting, r.used_blocks
        self.prompt_tokens, self.cached_prompt_tokens = r.prompt_tokens, r.cached_prompt_tokens
        self.preemptions = r.preemptions
        self.generation_tokens += r.generated
        self.ttft.observe_all(r.ttfts)
        self.itl.observe_all(r.itls)
        for reason, seconds in r.finished:
            self.finished_by[reason if reason in self.finished_by else "error"] += 1
            self.e2e.observe(seconds)
        self.num_aborted += r.aborted
        if r.num_steps:
            self.num_steps += r.num_steps
            self.recent.append((r.now, self.generation_tokens))
            while len(self.recent) > 2 and self.recent[0][0] < r.now - RATE_WINDOW_S:
                self.recent.popleft()

    def summary(self) -> str:
        done = sum(self.finished_by.values())
        return (f"{plural(done, 'answer')} finished, {self.num_aborted:,} aborted, "
                f"{plural(self.generation_tokens, 'token')} generated")

    def tokens_per_s(self, now: float) -> float:
        if len(self.recent) < 2 or self.recent[-1][0] < now - RATE_WINDOW_S:
            return 0.0
        (t0, n0), (t1, n1) = self.recent[0], self.recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self, waiting: int | None = None) -> str:
        """The text; `waiting`: the server's count of waiting answers (those on their way to the engine too)."""
        lb = self.labels
        hit_rate = self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lb}}} {value}"])

        metric("vllm:num_requests_running", "gauge", "Requests (answers) holding a slot in the batch.", self.running)
        metric("vllm:num_requests_waiting", "gauge", "Requests (answers) waiting for a slot.",
               self.waiting if waiting is None else waiting)
        metric("vllm:kv_cache_usage_perc", "gauge", "Share of the KV pool's blocks in use, 0 to 1.",
               self.used_blocks / self.total_blocks)
        metric("pagedcli:kv_blocks_used", "gauge", "KV blocks in use (all layers).", self.used_blocks)
        metric("pagedcli:kv_blocks_free", "gauge", "KV blocks free (all layers).", self.total_blocks - self.used_blocks)
        metric("pagedcli:kv_blocks_total", "gauge", "KV blocks in the pool (all layers).", self.total_blocks)
        metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               self.prompt_tokens)
        metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from cached blocks.",
               self.cached_prompt_tokens)
        metric("pagedcli:prefix_cache_hit_rate", "gauge", "Prompt tokens served from cached blocks / all.", hit_rate)
        metric("vllm:num_preemptions_total", "counter", "Preemptions (recomputed later).", self.preemptions)
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens admitted (recomputations included).",
               self.prompt_tokens)
        metric("vllm:generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("pagedcli:generation_tokens_per_second", "gauge",
               f"Tokens generated a second over the last {RATE_WINDOW_S:g} s.", self.tokens_per_s(time.perf_counter()))
        metric("pagedcli:engine_steps_total", "counter", "Engine steps run.", self.num_steps)
        metric("pagedcli:requests_aborted_total", "counter", "Answers aborted (client gone, shutdown).",
               self.num_aborted)
        out += ["# HELP vllm:request_success_total Answers finished, by reason.",
                "# TYPE vllm:request_success_total counter"]
        out += [f'vllm:request_success_total{{{lb},finished_reason="{r}"}} {n}' for r, n in self.finished_by.items()]
        for name, hist, help_ in (("vllm:time_to_first_token_seconds", self.ttft, "From arrival to the first token."),
                                  ("vllm:inter_token_latency_seconds", self.itl, "Between two tokens of an answer."),
                                  ("vllm:e2e_request_latency_seconds", self.e2e, "From arrival to the last token.")):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + hist.lines(name, lb)
        return "\n".join(out) + "\n"
