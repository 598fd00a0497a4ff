"""How long a `pagedcli bench` run may take, from what this model's steps cost here: said before a
long run starts (a 1B model on a CPU takes minutes a batch size)."""

from __future__ import annotations

import time
from dataclasses import replace

from pagedcli.bench.arrivals import arrival_times
from pagedcli.bench.measure import Workload, check_lengths, requests_for
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.engine.build import build_engine
from pagedcli.model.loader import Model

ANNOUNCE_S = 30.0  # a run estimated to take longer than this is announced before it starts
PROBE_TOKENS = 32  # the prompt timed for the estimate: long enough that its arithmetic shows


def time_steps(model: Model, opts: EngineOptions, w: Workload, batches: list[int],
               notice=lambda _: None) -> tuple[float, float]:
    """What a step of this model costs here, timed on the model itself: seconds for a step of one
    token (a decode step: every weight read once), and for each further token a step feeds (its
    arithmetic), from a prefill of PROBE_TOKENS tokens and two decode steps, after a step that
    warms up (first calls, the allocator). The workload's lengths are checked first: a run that
    would be refused is refused before anything is timed."""
    engine = build_engine(model, replace(opts, batch=1, prefix_caching=False), notice)
    check_lengths(requests_for(model, w, max(batches)), engine.cache.max_model_len, w)
    n = max(2, min(PROBE_TOKENS, engine.cache.max_model_len - 3))
    request = requests_for(model, replace(Workload(), input_len=str(n), output_len="3"), 1)[0]
    engine.run_to_completion([request.prompt_token_ids[:2]], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request(request.prompt_token_ids, SamplingParams(max_tokens=3, ignore_eos=True))
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step_s = min(times[1:])
    return step_s, max(0.0, times[0] - step_s) / (n - 1)


def estimate_seconds(model: Model, w: Workload, batches: list[int], step_s: float, token_s: float,
                     runs: int = 1) -> tuple[float, int, int]:
    """How long the sweep may take, from what a step costs (time_steps): step_s a step, and token_s
    for each token a step feeds beyond its first. A run feeds every prompt once, then a token per
    decode step, its requests in waves of `batch`, each as long as its longest; the warm-up counts
    too. `runs`: the workload's runs per batch size (a second without the prefix cache,
    transformers' generate). Returns seconds, tokens fed and steps."""
    seconds = tokens = steps = 0
    for batch in batches:
        requests = requests_for(model, w, batch)
        waves = [requests[i:i + batch] for i in range(0, len(requests), batch)]
        fed = sum(len(r.prompt_token_ids) for r in requests + waves[0]) + 3 * len(waves[0])  # + the warm-up
        taken = 4 + len(waves)  # the warm-up's four steps, a prefill a wave
        for wave in waves:
            decode = max(r.max_tokens for r in wave) - 1
            taken += decode
            fed += decode * len(wave)
        # under --request-rate a run lasts at least until its last request arrives
        arrive = arrival_times(len(requests), w.request_rate, w.seed)[-1] if requests else 0.0
        seconds += runs * max(taken * step_s + (fed - taken) * token_s, arrive)
        tokens += runs * fed
        steps += runs * taken
    return seconds, tokens, steps
