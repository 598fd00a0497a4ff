"""Next-token choice: greedy, or temperature with min-p / top-k / top-p, seeded per request, after
the penalties (logits_processors.py); and the log-probabilities a request asks for.

Greedy rows share one argmax (the runner's) unless a grammar's mask (structured.py) or penalties
change their logits: then theirs is taken after them (the mask first: disallowed tokens at -inf). Sampled rows each draw with their own generator, seeded from the
request's seed, so a request's samples do not depend on what else is in the batch.

A row whose logits are not all finite (an overflow in float16, a NaN weight) gets the token
NOT_FINITE instead: the scheduler ends that request with an error, and the others go on. For
greedy rows the backend's argmax says so (on a GPU inside the same kernel, and inside the decode
graph); a sampled row is checked before its draw. The answer comes back with the tokens (no sync).

Log-probabilities are vLLM's default (raw logprobs): the log-softmax of the model's logits, before
penalties and temperature, for the chosen token and the N likeliest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedcli.core.batch import NOT_FINITE
from pagedcli.engine.logits_processors import Penalties, warp
from pagedcli.engine.sequence import Sequence


class Sampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.penalties = Penalties(num_slots, vocab_size, device)

    def sample(self, logits: torch.Tensor, greedy: torch.Tensor, seqs: list[Sequence],
               allowed: tuple[list[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, StepLogprobs | None]:
        """logits: [B, vocab] float32, row b for seqs[b]; greedy: [B] int64, their argmax (the runner's,
        NOT_FINITE where a row is not all finite), which other rows overwrite; allowed: the rows a
        grammar holds and [rows, vocab] bool, the tokens each may take (structured.py). Returns [B]
        int64 tokens where the logits are, and the log-probabilities asked for: nothing waits for them."""
        raw, tokens = logits, greedy
        penalized = [b for b, seq in enumerate(seqs) if seq.params.has_penalties]
        sampled = [b for b, seq in enumerate(seqs) if not seq.params.greedy]
        if penalized or sampled or allowed:
            bad = greedy == NOT_FINITE  # the argmax looked at every row
        ok = torch.ones_like(logits, dtype=torch.bool) if allowed else None  # logits a row may take
        if allowed:  # disallowed tokens at -inf; the greedy choice taken again within the grammar
            constrained, mask = allowed
            index = torch.tensor(constrained).to(logits.device, non_blocking=True)
            logits = logits.index_copy(0, index, logits[index].masked_fill(~mask, float("-inf")))
            ok = ok.index_copy(0, index, mask)
            tokens = greedy.index_copy(0, index, logits[index].argmax(-1))
        if penalized:  # their argmax is taken after the penalties (a sampled row's is overwritten below)
            index = torch.tensor(penalized).to(logits.device, non_blocking=True)
            rows, slots = self.penalties.apply(logits[index], [seqs[b] for b in penalized])
            logits = logits.index_copy(0, index, rows)  # a copy: the raw logits stay for logprobs
            finite = torch.isfinite(rows) | ~ok[index] if ok is not None else torch.isfinite(rows)
            bad = bad.index_copy(0, index, bad[index] | ~finite.all(-1))  # (an overflow in them)
            tokens = tokens.index_copy(0, index, rows.argmax(-1))
        if sampled and tokens is greedy:  # written row by row below: the runner's tensor (a graph's
            tokens = greedy.clone()       # static output, made in inference mode) stays as it is
        for b in sampled:  # a row that is not finite draws from zeros (multinomial refuses NaN)
            tokens[b], finite = _draw(torch.where(bad[b], 0.0, logits[b]), seqs[b])
            bad[b] |= ~finite
        if penalized or sampled or allowed:
            tokens = torch.where(bad, NOT_FINITE, tokens)
        if penalized:
            self.penalties.count(slots, tokens[index])
        return tokens, StepLogprobs.of(raw, tokens, seqs)


def _draw(logits: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """One token drawn from `logits` as `seq` samples, and whether its distribution was finite: one
    that is not (what the temperature or the penalties made of it overflowed) draws from a uniform
    one instead, so that multinomial, which refuses NaN and would fail every row of the step, takes
    it; the row then ends as NOT_FINITE, and its batch mates go on."""
    p = seq.params
    if seq.generator is None:
        seq.generator = torch.Generator(device=logits.device)
        if p.seed is not None:
            seq.generator.manual_seed(p.seed)
        else:
            seq.generator.seed()
    probs = warp(logits, p).softmax(-1)
    finite = torch.isfinite(probs).all()
    return torch.multinomial(torch.where(finite, probs, 1.0), 1, generator=seq.generator)[0], finite


class TokenLogprobs(NamedTuple):
    """One output token's: its log-probability, its rank (1: the likeliest), the top (id, logprob)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class StepLogprobs:
    """The log-probabilities of one step's rows that ask for them, on the device, then on the host."""

    def __init__(self, rows: list[int], chosen: torch.Tensor, rank: torch.Tensor, top_values: torch.Tensor,
                 top_ids: torch.Tensor):
        self.rows = rows
        self.tensors = [chosen, rank, top_values, top_ids]

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> StepLogprobs | None:
        rows = [b for b, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return None
        index = torch.tensor(rows).to(logits.device, non_blocking=True)
        logprobs = logits[index].log_softmax(-1)
        chosen = logprobs.gather(1, tokens[index].clamp(min=0)[:, None])  # a NOT_FINITE row ends: any id does
        rank = (logprobs >= chosen).sum(-1)  # vLLM's rank: 1 for the likeliest
        top = logprobs.topk(max(seqs[b].params.logprobs for b in rows), dim=-1)
        return cls(rows, chosen[:, 0], rank, top.values, top.indices)

    def to_host(self) -> None:
        """Start the copy to the host (pinned memory, no wait): the step's `ready` event covers it."""
        if self.tensors[0].is_cuda:
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.tensors]
            for host, t in zip(pinned, self.tensors):
                host.copy_(t, non_blocking=True)
            self.tensors = pinned

    def attach(self, seqs: list[Sequence]) -> None:
        """Once on the host: give each row's sequence its token's entry, if the token was appended
        (not a stop token, not a row dropped because the sequence had already ended)."""
        chosen, rank, values, ids = (t.tolist() for t in self.tensors)
        for i, b in enumerate(self.rows):
            seq = seqs[b]
            if len(seq.logprobs) < len(seq.output_token_ids):
                n = seq.params.logprobs
                seq.logprobs.append(TokenLogprobs(chosen[i], rank[i], list(zip(ids[i][:n], values[i][:n]))))


class PromptLogprobs:
    """The log-probabilities of prompt tokens, from a prefill step's rows for them (runner.py's
    prompt_logits): the row at position p gives the prompt token at p + 1 its log-probability,
    rank and the N likeliest there. The first prompt token has none (vLLM's null). Computed on the
    device as the step is queued; on the host they join each sequence's `prompt_logprobs`."""

    def __init__(self, rows: list[tuple[Sequence, int, torch.Tensor]]):
        self.parts = []
        for seq, first, logits in rows:
            prompt = seq.prompt_token_ids
            n = min(logits.shape[0], len(prompt) - 1 - first)  # rows that predict a prompt token
            if n <= 0:
                continue
            logprobs = logits[:n].float().log_softmax(-1)
            targets = torch.tensor(prompt[first + 1:first + 1 + n]).to(logits.device)
            chosen = logprobs.gather(1, targets[:, None])
            rank = (logprobs >= chosen).sum(-1)
            top = logprobs.topk(max(seq.params.prompt_logprobs, 1), dim=-1)
            self.parts.append((seq, first, targets, chosen[:, 0], rank, top.values, top.indices))

    def attach(self) -> None:
        """Each prompt token's entry, in order, on its sequence (a recomputed prompt, after a
        preemption, adds none twice)."""
        for seq, first, targets, chosen, rank, values, ids in self.parts:
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first token: nothing before it
            k = seq.params.prompt_logprobs
            chosen, rank, values, ids = chosen.tolist(), rank.tolist(), values.tolist(), ids.tolist()
            for i in range(len(chosen)):
                if first + 1 + i == len(seq.prompt_logprobs):  # the next one it lacks
                    seq.prompt_logprobs.append(TokenLogprobs(chosen[i], rank[i], list(zip(ids[i][:k], values[i][:k]))))
