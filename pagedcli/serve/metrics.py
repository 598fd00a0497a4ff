"""GET /metrics: Prometheus' text format, with vLLM's metric names where vLLM has one (so its
dashboards work) and pagedcli's own for the rest (the pool's blocks, the hit rate, tokens/s).

The engine thread updates the numbers after each step; the event loop renders them; a lock keeps
a render from reading a step half-counted. Written out here, not with prometheus_client, which
the server does not need (the tests parse the text with it)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

from pagedcli.errors import plural

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

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.buckets, self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        total += self.counts[-1]
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {total}', f"{name}_sum{{{labels}}} {self.sum}",
                f"{name}_count{{{labels}}} {total}"]
        return out


class Metrics:
    def __init__(self):
        self.labels = ""  # model_name="...", once the model is known
        self.lock = threading.Lock()
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)
        self.generation_tokens = 0
        self.finished_by = dict.fromkeys(FINISH_REASONS, 0)
        self.num_aborted = 0
        # copied from the engine after each step
        self.running = self.waiting = self.used_blocks = self.num_steps = 0
        self.total_blocks = 1
        self.prompt_tokens = self.cached_prompt_tokens = self.preemptions = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, generation tokens so far), one per step

    # --- the engine thread ------------------------------------------------------------------------
    def describe(self, engine, model_name: str) -> None:
        with self.lock:
            self.labels = 'model_name="{}"'.format(model_name.replace("\\", "\\\\").replace('"', '\\"'))
            self.total_blocks = engine.cache.geometry.num_blocks

    def tokens(self, seq, n: int, first: bool) -> None:
        """`n` new tokens of `seq` handed out (`first`: its first ones)."""
        if not n:
            return
        with self.lock:
            self.generation_tokens += n
            if first:
                self.ttft.observe(seq.first_token_time - seq.arrival_time)
            elif len(seq.token_times) > 1:
                self.itl.observe(seq.token_times[-1] - seq.token_times[-2])

    def finished(self, seq, now: float) -> None:
        with self.lock:
            reason = seq.finish_reason if seq.finish_reason in self.finished_by else "error"
            self.finished_by[reason] += 1
            self.e2e.observe(now - seq.arrival_time)

    def aborted(self, n: int) -> None:
        with self.lock:
            self.num_aborted += n

    def gauges(self, engine) -> None:
        """The engine's state now: after a step, or an abort (which an idle engine follows by no step)."""
        sched, cache = engine.scheduler, engine.cache
        with self.lock:
            self.running, self.waiting = len(sched.running), len(sched.waiting)
            self.used_blocks = self.total_blocks - cache.num_free_blocks
            self.prompt_tokens, self.cached_prompt_tokens = sched.prompt_tokens, sched.cached_prompt_tokens
            self.preemptions = sched.num_preemptions

    def step(self, engine, now: float) -> None:
        self.gauges(engine)
        with self.lock:
            self.num_steps += 1
            self.recent.append((now, self.generation_tokens))
            while len(self.recent) > 2 and self.recent[0][0] < now - RATE_WINDOW_S:
                self.recent.popleft()

    # --- the event loop ---------------------------------------------------------------------------
    def summary(self) -> str:
        with self.lock:
            done = sum(self.finished_by.values())
            return (f"{plural(done, 'answer')} finished, {self.num_aborted:,} aborted, "
                    f"{plural(self.generation_tokens, 'token')} generated")

    def tokens_per_s(self, now: float) -> float:
        if len(self.recent) < 2 or self.recent[-1][0] < now - RATE_WINDOW_S:
            return 0.0
        (t0, n0), (t1, n1) = self.recent[0], self.recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self, waiting: int | None = None) -> str:
        """The text; `waiting`: the server's count of waiting requests (its inbox too)."""
        with self.lock:
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
