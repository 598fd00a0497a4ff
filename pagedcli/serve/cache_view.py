"""GET /v1/cache: the cache between two steps as JSON, with the fields of `inspect-cache --json`
for each running request (its blocks in every layer, byte offsets, what they hold, what they
share), its client's request id beside them, and the pool's and the queue's totals."""

from __future__ import annotations

import functools

from pagedcli.console.cache_json import ranks_json
from pagedcli.console.cache_json import to_json as slot_json


def no_text(_ids) -> str:  # a model without a tokenizer (random weights): token ids only
    return ""


def to_json(snap, tokenizer) -> dict:
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False) if tokenizer is not None else no_text
    geo = snap.geometry
    return {
        "step": snap.step,
        "free_blocks": snap.num_free_blocks,
        "used_blocks": snap.num_used_blocks,
        "total_blocks": geo.num_blocks,
        "max_slots": snap.max_slots,
        "max_model_len": snap.max_model_len,
        "prefix_hit_rate": snap.prefix_hit_rate,
        "num_preemptions": snap.num_preemptions,
        "num_finished": snap.num_finished,
        "num_aborted": snap.num_aborted,
        "ranks": ranks_json(snap),
        "waiting": [{"request_id": w.request_id, "id": w.seq_id, "num_tokens": w.num_tokens,
                     "num_preemptions": w.num_preemptions} for w in snap.waiting],
        "running": [{"request_id": view.request_id} | slot_json(snap, view, decode) for view in snap.slots],
    }
