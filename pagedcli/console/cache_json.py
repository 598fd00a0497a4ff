"""The cache as JSON: a running request's blocks in every layer with their byte offsets into the
pool and what they hold (`inspect-cache --json`, and each request of the server's /v1/cache)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the command line loads torch only once a command runs)
    from pagedcli.engine.snapshot import CacheSnapshot, SlotView


def block_token_ids(view: SlotView, block_size: int) -> list[list[int]]:
    """The token ids in each logical block: only those whose K/V are in the cache."""
    ids = view.token_ids[: view.num_cached]
    return [list(ids[i * block_size:(i + 1) * block_size]) for i in range(view.num_blocks)]


def block_texts(decode, blocks: list[list[int]]) -> list[str]:
    """Each block's text, cut from the decoded text of the whole sequence so far, so a block keeps
    the leading spaces a tokenizer only shows in context."""
    texts, ids, before = [], [], ""
    for block in blocks:
        ids += block
        text = decode(ids)
        texts.append(text[len(before):])
        before = text
    return texts


def shared_with(snap: CacheSnapshot, view: SlotView) -> list[dict[int, list[int]]]:
    """For each layer: which other running slots hold each of this slot's blocks too (a cached
    prefix, or parallel samples of one prompt)."""
    mine = [set(row) for row in view.table]
    shared: list[dict[int, list[int]]] = [{} for _ in view.table]
    for other in snap.slots:
        if other.slot != view.slot:
            for layer, row in enumerate(other.table):
                for block in mine[layer].intersection(row):
                    shared[layer].setdefault(block, []).append(other.slot)
    return shared


def ranks_json(snap: CacheSnapshot) -> list[dict]:
    """Tensor parallelism: each rank's KV heads of every block, in its own pool at the same offsets
    (empty on one device)."""
    return [{"rank": r.rank, "device": r.device, "kv_heads": list(r.kv_heads), "pool_address": r.pool_address,
             "pool_bytes": r.pool_bytes} for r in snap.ranks]


def to_json(snap: CacheSnapshot, view: SlotView, decode) -> dict:
    """Every layer's blocks with their byte offsets into the pool, and what they hold."""
    geo = snap.geometry
    token_blocks = block_token_ids(view, geo.block_size)
    texts = block_texts(decode, token_blocks)
    shared = shared_with(snap, view)

    def block_json(layer: int, i: int, p: int) -> dict:
        block = {"logical": i, "token_ids": token_blocks[i], "text": texts[i]}
        if p < 0:  # given back behind the sliding window: no physical block, no bytes
            return block | {"physical": None, "k_offset": None, "v_offset": None, "ref_count": 0, "shared_with": [],
                            "released": True}
        return block | {"physical": p, "k_offset": p * geo.block_bytes, "v_offset": p * geo.block_bytes + geo.v_offset,
                        "ref_count": 1 + len(shared[layer].get(p, [])), "shared_with": shared[layer].get(p, []),
                        "released": False}

    return {
        "slot": view.slot,
        "step": snap.step,
        "geometry": {"block_size": geo.block_size, "block_bytes": geo.block_bytes, "v_offset": geo.v_offset,
                     "num_blocks": geo.num_blocks, "num_layers": geo.num_layers, "pool_bytes": geo.pool_bytes,
                     "dtype": str(geo.dtype).removeprefix("torch."),
                     "kv_dtype": str(geo.kv_dtype).removeprefix("torch.")},
        "weights": snap.weights,
        "free_blocks": snap.num_free_blocks,
        "used_blocks": snap.num_used_blocks,
        "request": {"id": view.seq_id, "prompt": view.prompt},
        "prompt_token_ids": list(view.token_ids[: view.num_prompt_tokens]),
        "output_token_ids": list(view.token_ids[view.num_prompt_tokens:]),
        "num_cached": view.num_cached,
        "prefill": {"computed": view.num_cached, "of": view.prefill_len} if view.is_prefilling else None,
        "layers": [
            {"layer": layer, "blocks": [block_json(layer, i, p) for i, p in enumerate(row)]}
            for layer, row in enumerate(view.table)],
        "sliding_window": snap.sliding_window,
        "released_blocks": view.num_released,  # logical blocks given back behind the window, in each layer
        "ranks": ranks_json(snap),
    }
