"""What sampling does to logits before it draws, in vLLM's order:

    penalties (repetition, presence, frequency)  ->  temperature  ->  min_p  ->  top_k  ->  top_p

Penalties change the logits of greedy rows too (their argmax is taken after them). Each function
takes logits over the last dimension, one row or [rows, vocab], and returns new ones; a token
ruled out gets -inf.

`Penalties` keeps what the penalties need to know of each sequence on the logits' device, so a
step asks nothing of the host but the rows' slots.
"""

from __future__ import annotations

import torch

from pagedcli.engine.sequence import Sequence

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; prompt_mask [R, V] bool: the tokens of each row's prompt; output_counts [R, V]:
    how often each token is in the row's output; the penalties [R]. As vLLM and transformers: a
    token seen in the prompt or the output has a positive logit divided by the repetition penalty,
    a negative one multiplied; as OpenAI documents it, each output token's logit is lowered by
    frequency * count + presence * [count > 0]."""
    in_output = output_counts > 0
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | in_output, penalized, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than min_p times the likeliest (which always stays)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), NEG_INF)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose probability reaches p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= p
    drop[..., 0] = False  # the likeliest token always (transformers, vLLM): a top_p that is 0 in float32 drops all
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), NEG_INF)


def warp(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then min_p, top_k, top_p (each only when on): the logits a sampled row draws from."""
    logits = logits / params.temperature
    if params.min_p > 0:
        logits = apply_min_p(logits, params.min_p)
    if params.top_k > 0:
        logits = apply_top_k(logits, params.top_k)
    if params.top_p < 1.0:
        logits = apply_top_p(logits, params.top_p)
    return logits


class Penalties:
    """Per slot, on the device: a mask of its sequence's prompt tokens, each token's count in its
    output, and its three penalties. Made on first use (a penalized request), [slots, vocab] each.

    A token is counted on the device when it is drawn (`count`), in stream order: a decode step
    that the engine queues before the host has the previous step's tokens (its overlap) counts the
    token it feeds, which the host's output_token_ids lack then. A sequence new to its slot
    (admitted, recomputed after a preemption, forked) is counted afresh from its host token
    lists, which are whole then: a prefill is never queued ahead of the step before it."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.owner: list[Sequence | None] = [None] * num_slots  # whose tokens each slot's row holds
        self.prompt_mask = self.output_counts = self.values = None

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The penalized logits of `seqs`' rows ([len(seqs), vocab]), and the rows' slots on the device."""
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32, device=self.device)
            self.values = torch.ones(self.num_slots, 3, device=self.device)  # repetition, presence, frequency
        for seq in seqs:
            if self.owner[seq.slot] is not seq:
                self._take(seq)
        slots = torch.tensor([s.slot for s in seqs]).to(self.device, non_blocking=True)
        values = self.values[slots]
        return apply_penalties(logits, self.prompt_mask[slots], self.output_counts[slots],
                               values[:, 0], values[:, 1], values[:, 2]), slots

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's new token (one the sampler flagged not finite ends its sequence: skipped)."""
        valid = tokens >= 0
        self.output_counts.index_put_((slots, tokens.clamp(min=0)), valid.to(torch.int32), accumulate=True)

    def _take(self, seq: Sequence) -> None:
        """Count `seq`'s tokens into its slot's row, from scratch (device ops only: no wait for the GPU)."""
        p, slot = seq.params, seq.slot

        def on_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        self.prompt_mask[slot] = False
        self.prompt_mask[slot, on_device(seq.prompt_token_ids, torch.int64)] = True
        output = on_device(seq.output_token_ids, torch.int64)  # not empty after a preemption
        self.output_counts[slot] = 0
        self.output_counts[slot].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self.values[slot] = on_device([p.repetition_penalty, p.presence_penalty, p.frequency_penalty], torch.float32)
        self.owner[slot] = seq
