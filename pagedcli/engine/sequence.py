"""A request as the engine tracks it: its tokens, its slot, how much of it is in the cache."""

from __future__ import annotations

import enum
import time

import torch

from pagedcli.core.options import SamplingParams


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
        self.prompt_logprobs: list = []  # with params.prompt_logprobs: None, then one TokenLogprobs a prompt token
        self.matcher = None  # with params.structured: its grammar's matcher (structured.py)
        self.matched = 0  # output tokens the matcher has taken
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
