"""Next-token choice: greedy, or temperature with top-k / top-p, seeded per request.

Greedy rows share one argmax. Sampled rows each draw with their own generator, seeded from the
request's seed, so a request's samples do not depend on what else is in the batch.

A row whose logits are not all finite (an overflow in float16, a NaN weight) gets the token
NOT_FINITE instead: the scheduler ends that request with an error, and the others go on. The check
is one pass over the logits on their device, and its answer comes back with the tokens (no sync).
"""

from __future__ import annotations

import torch

from pagedcli.engine.sequence import Sequence

NOT_FINITE = -1  # the token of a row whose logits hold a NaN or an inf


def sample(logits: torch.Tensor, greedy: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [B, vocab] float32, row b for seqs[b]; greedy: [B] int64, their argmax (the runner's),
    which sampled rows overwrite. Returns [B] int64 tokens where the logits are (NOT_FINITE for a row
    that is not all finite): nothing waits for them."""
    finite = logits.isfinite().all(dim=-1)  # [B]
    tokens = greedy
    sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
    for b in sampled:  # a row that is not finite draws from zeros instead: its token is replaced anyway
        tokens[b] = _draw(torch.where(finite[b], logits[b], 0.0), seqs[b])
    return torch.where(finite, tokens, NOT_FINITE)


def _draw(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if seq.generator is None:
        seq.generator = torch.Generator(device=logits.device)
        if p.seed is not None:
            seq.generator.manual_seed(p.seed)
        else:
            seq.generator.seed()
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # and the likeliest token always (transformers, vLLM): a top_p that is 0 in float32 drops all
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=seq.generator)[0]
