"""What a step reports: its counts when it is queued (StepCounts), the step on its way (QueuedStep:
its tokens on the device, and on their way to the host), and what it did once they arrived
(StepOutput), which the commands stream, the live view draws and the benchmark times."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedcli.engine.sampler import PromptLogprobs, StepLogprobs
from pagedcli.engine.sequence import Sequence


@dataclass(kw_only=True)
class StepCounts:
    """A step's size and the cache around it, counted as it is queued."""

    is_prefill: bool  # prompt tokens ran: prompts or chunks of them, maybe beside decoding sequences' tokens
    num_tokens: int = 0  # tokens fed through the network
    num_decode: int = 0  # of those, the tokens of sequences decoding (in a prefill step: beside prompt chunks)
    used_blocks: int = 0  # blocks in use during the step (before finished sequences give theirs back)
    num_running: int = 0  # sequences holding a slot during the step


@dataclass(kw_only=True)
class StepOutput(StepCounts):
    seqs: list[Sequence]  # the sequences that ran and sampled
    tokens: list[int]  # the token each sampled (a stop token is sampled but not appended)
    finished: list[Sequence] = field(default_factory=list)
    prefilling: list[Sequence] = field(default_factory=list)  # ran a prompt chunk short of the prompt's end

    @property
    def idle(self) -> bool:
        """Nothing ran (nothing could be scheduled)."""
        return not self.seqs and not self.prefilling


@dataclass(kw_only=True)
class QueuedStep:
    """A step queued on the device: its sampled tokens exist there, and are on their way to the host."""

    counts: StepCounts
    seqs: list[Sequence]  # the rows that sample
    tokens: torch.Tensor  # [len(seqs)] int64 on the device: what the next step feeds without a round trip
    host_tokens: torch.Tensor  # the same on the host (pinned memory on a GPU), once `ready` has passed
    ready: torch.cuda.Event | None  # None on the CPU: the tokens are there already
    # rows that fed a prompt chunk short of their prompt's end, and how many tokens: they sample nothing
    chunks: tuple[list[Sequence], list[int]] = field(default_factory=lambda: ([], []))
    logprobs: StepLogprobs | None = None  # on their way to the host with the tokens
    prompt_logprobs: PromptLogprobs | None = None  # prompt tokens' (prefill steps that ask for them)

    def tokens_on_host(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # this step only: a step queued after it keeps running
        return self.host_tokens.tolist()
