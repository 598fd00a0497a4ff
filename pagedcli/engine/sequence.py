"""A request as the engine tracks it: its tokens, its slot, how much of it is in the cache."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass

import torch

from pagedcli.defaults import DEFAULTS


# Temperatures below this sample as greedy (vLLM's choice): dividing the logits by a temperature
# near zero overflows them, and the distribution is the argmax's long before that.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # the most top tokens a step reports (vLLM's default cap)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range, vLLM's check)
# The repetition penalty lies in [1/R, R]: a logit divided by one near 0 overflows float32 (inf, then a
# NaN distribution that no draw takes), and one past float32's range is inf (0 * inf is NaN)
MAX_REPETITION_PENALTY = 1e4


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of sampling, with vLLM's names and meanings (logits_processors.py)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; prompt and output tokens
    presence_penalty: float = 0.0  # 0: off; output tokens
    frequency_penalty: float = 0.0  # 0: off; output tokens
    max_tokens: int = DEFAULTS.max_tokens
    ignore_eos: bool = DEFAULTS.ignore_eos
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these it contains
    logprobs: int | None = None  # None: off; N: the chosen token's log-probability and the N likeliest

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def problem(self) -> tuple[str, object, str, str | None] | None:
        """The first setting no sampler can use, as (field, value, why, hint); None if all are fine."""
        def finite(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        checks = [
            ("temperature", finite(self.temperature) and self.temperature >= 0,
             "must be 0 (greedy) or a positive number", None),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]", "1 turns it off"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or more", None),
            ("min_p", finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]", "0 turns it off"),
            ("repetition_penalty", finite(self.repetition_penalty)
             and 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"must be a positive number from {1 / MAX_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g}",
             "1 turns it off; above 1 discourages repeats"),
            ("presence_penalty", finite(self.presence_penalty) and abs(self.presence_penalty) <= MAX_PENALTY,
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", "0 turns it off"),
            ("frequency_penalty", finite(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_PENALTY,
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", "0 turns it off"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1", None),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits",
             "use a number from -2**63 to 2**63 - 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be from 0 to {MAX_LOGPROBS}", "0 gives only the chosen token's"),
        ]
        for name, ok, why, hint in checks:
            if not ok:
                return name, getattr(self, name), why, hint
        if "" in self.stop:
            return "stop", "''", "a stop string must not be empty", None
        return None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None):
        self.id = seq_id
        self.prompt = prompt
        self.request_id: str | None = None  # the client's name for it (serve), shown by the live view
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []  # grown by append_token() only, which counts it
        self.num_tokens = len(self.prompt_token_ids)  # prompt + output: len(), asked for several times a step
        self.params = params
        self.status = Status.WAITING
        self.slot: int | None = None
        self.num_cached = 0  # tokens whose K/V are in the cache (all layers)
        self.prefill_len = 0  # the tokens its prefill computes before it samples: len() when (re)admitted
        self.finish_reason: str | None = None  # "stop", "length" or "error"
        self.error: str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of its full blocks, as far as computed (prefix_cache.py)
        self.generator: torch.Generator | None = None  # made on the logits' device at first sampling
        self.stop_strings = None  # a StopStrings watching its text, when params.stop has any (stop_strings.py)
        self.logprobs: list = []  # with params.logprobs: one TokenLogprobs per output token (sampler.py)
        # timing, for bench and the live view
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.token_times: list[float] = []

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return self.num_tokens

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop], without joining the prompt and the output (a step's new tokens
        are a few at the end of a long sequence)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        """Admitted, and its prefill not done: it samples only once all `prefill_len` tokens are in
        the cache (chunked prefill feeds them over several steps)."""
        return self.num_cached < self.prefill_len

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, status={self.status.value}, slot={self.slot}, len={len(self)})"
