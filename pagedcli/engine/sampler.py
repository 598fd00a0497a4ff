"""Next-token choice: greedy, or temperature with top-k / top-p, seeded per request.

Greedy rows share one argmax. Sampled rows each draw with their own generator, seeded from the
request's seed, so a request's samples do not depend on what else is in the batch.

A row whose logits are not all finite (an overflow in float16, a NaN weight) gets the token
NOT_FINITE instead: the scheduler ends that request with an error, and the others go on. For
greedy rows the backend's argmax says so (on a GPU inside the same kernel, and inside the decode
graph); a sampled row is checked before its draw. The answer comes back with the tokens (no sync).
"""

from __future__ import annotations

import torch

from pagedcli.backends import NOT_FINITE
from pagedcli.engine.sequence import Sequence



def sample(logits: torch.Tensor, greedy: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [B, vocab] float32, row b for seqs[b]; greedy: [B] int64, their argmax (the runner's,
    NOT_FINITE where a row is not all finite), which sampled rows overwrite. Returns [B] int64
    tokens where the logits are: nothing waits for them."""
    tokens = greedy
    sampled = [b for b, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        bad = greedy == NOT_FINITE  # the argmax looked at every row, sampled ones too
        for b in sampled:  # a row that is not finite draws from zeros (multinomial refuses NaN)
            tokens[b] = _draw(torch.where(bad[b], 0.0, logits[b]), seqs[b])
        tokens = torch.where(bad, NOT_FINITE, tokens)
    return tokens


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
