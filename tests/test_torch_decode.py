"""The decode attention the CUDA backend runs as torch ops where its kernel cannot serve a
geometry (backends/torch_decode.py), on the CPU: equal to an fp64 attention read through the block
table, blind to what other sequences' blocks hold (inf and NaN included), zeros for a padding row."""

from __future__ import annotations

import math

import torch

from pagedcli.backends.torch_decode import decode_attention_full_width
from pagedcli.engine.cache import KVCache
from pagedcli.model.config import ModelConfig
from pagedcli.core.geometry import CacheGeometry


def make_cache(heads=6, kv_heads=2, head_dim=10, block_size=8, lengths=(1, 8, 9, 30), max_len=64):
    config = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": heads * head_dim,
                                    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": heads,
                                    "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 50,
                                    "max_position_embeddings": max_len}, source="test")
    geo = CacheGeometry.build(config, torch.float32, block_size, num_blocks=64)
    cache = KVCache(geo, 5, max_len, torch.device("cpu"), shuffle_seed=3)
    torch.manual_seed(0)
    cache.store.pool.copy_(torch.randn(cache.store.pool.shape))
    slots = [3, 0, 4, 1][: len(lengths)]  # sequence b is not slot b
    for slot, n in zip(slots, lengths):
        cache.grow(slot, n)
    return config, cache, slots


def reference(cache, layer, q, lengths, slots):
    geo, out = cache.geometry, []
    gqa = q.shape[1] // geo.num_kv_heads
    for b, (n, slot) in enumerate(zip(lengths, slots)):
        blocks = torch.as_tensor(cache.table[slot, layer, : math.ceil(n / geo.block_size)]).long()
        kv = cache.store.pool[blocks].double()
        k = kv[:, 0].reshape(-1, geo.num_kv_heads, geo.head_dim)[:n].repeat_interleave(gqa, dim=1)
        v = kv[:, 1].reshape(-1, geo.num_kv_heads, geo.head_dim)[:n].repeat_interleave(gqa, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) / math.sqrt(geo.head_dim)
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(out)


def run(cache, config, layer, q, lengths, slots):
    table = torch.as_tensor(cache.table)[:, layer]
    width = cache.max_blocks_per_seq * cache.geometry.block_size
    return decode_attention_full_width(q, cache.store.pool, table, torch.tensor(slots, dtype=torch.int32),
                                       torch.tensor(lengths, dtype=torch.int32), width)


def test_equals_fp64_attention_through_shuffled_blocks():
    lengths = (1, 8, 9, 30)
    config, cache, slots = make_cache(lengths=lengths)
    q = torch.randn(len(lengths), config.num_heads, config.head_dim)
    for layer in (0, 1):
        out = run(cache, config, layer, q, lengths, slots)
        torch.testing.assert_close(out.double(), reference(cache, layer, q, lengths, slots), atol=1e-5, rtol=1e-5)


def test_other_sequences_poison_does_not_leak_and_padding_gives_zeros():
    lengths = (5, 20)
    config, cache, slots = make_cache(lengths=lengths)
    q = torch.randn(3, config.num_heads, config.head_dim)
    clean = run(cache, config, 1, q[:2], lengths, slots)
    # every block this layer's two sequences do not own gets inf and NaN: unowned table positions
    # and the unused rows of their last blocks are past their contexts
    owned = {int(b) for s in slots for b in cache.table[s, 1] if b >= 0}
    for b in range(cache.geometry.num_blocks):
        if b not in owned:
            cache.store.pool[b, 0] = float("inf")
            cache.store.pool[b, 1] = float("nan")
    last = int(cache.table[slots[0], 1, 0])
    cache.store.pool[last, :, 5:] = float("nan")  # sequence 0 holds 5 of this block's 8 rows
    out = run(cache, config, 1, q, lengths + (0,), slots + [2])  # and a padding row (context 0)
    assert torch.equal(out[:2], clean)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
