"""Requests that arrive over time, as vLLM's serving benchmark sends them (`--request-rate`).

Arrivals are a Poisson process of `rate` requests a second: the first at the start, then
inter-arrival times drawn from an exponential distribution of mean 1/rate, seeded. An infinite
rate sends every request at the start (the bench's plain run). The bench hands a request to the
engine once its arrival time has passed: it checks the clock between steps, and when nothing runs
it sleeps until the next arrival. So time to first token and inter-token latency are measured
while prompts arrive among sequences that are decoding.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `n` requests arrives, in order."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals {seed}")  # its own stream: the prompts' draws stay what they were
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


class Arrivals:
    """Which requests have arrived, by a clock started with `begin()`."""

    def __init__(self, times: list[float], clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.times = times  # ascending, seconds after the start
        self.clock, self.sleep = clock, sleep
        self.start = 0.0
        self.next = 0  # the first request not handed out yet

    def begin(self) -> float:
        self.start = self.clock()
        return self.start

    def due(self) -> range:
        """The requests (indices) that have arrived since the last call."""
        now, first = self.clock() - self.start, self.next
        while self.next < len(self.times) and self.times[self.next] <= now:
            self.next += 1
        return range(first, self.next)

    @property
    def pending(self) -> bool:
        """Requests still to arrive."""
        return self.next < len(self.times)

    def wait(self) -> None:
        """Nothing runs: sleep until the next request arrives."""
        self.sleep(max(0.0, self.start + self.times[self.next] - self.clock()))
