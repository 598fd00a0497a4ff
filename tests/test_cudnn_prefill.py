"""The host side of cudnn_prefill.py (whole long prompts through cuDNN's attention on sm_90+), on the
CPU: which sequences of a step take it, that paged_prefill.cu's tiles then leave them out, and that
the gather of a prompt's K/V through its shuffled blocks and the causal product over it are the
torch backend's attention for that step. cuDNN itself runs in the GPU tests."""

from __future__ import annotations


import torch

from pagedcli.backends.cuda_launch import prefill_tile_lists
from pagedcli.backends.cudnn_prefill import (CUDNN_MIN_TOKENS, _causal, gather_kv, padded_length, planned_lengths,
                                             whole_prompt_rows)
from pagedcli.backends.torch import TorchBackend
from pagedcli.core.batch import StepBatch
from pagedcli.engine.cache import KVCache
from pagedcli.core.geometry import CacheGeometry
from cuda_checks import make_config

N = CUDNN_MIN_TOKENS


def test_whole_prompts_of_the_minimum_length_and_nothing_cached_take_cudnn():
    # (new tokens, context after the step): decoding rows, a prompt of N, a chunk after a cached
    # prefix, a first chunk of N + 1 (its context is the step's own), one token short of N
    num_new = [1, 1, N, N, N + 1, N - 1, 40]
    context = [64, 300, N, N + 5, N + 1, N - 1, 40]
    assert whole_prompt_rows(num_new, context, first=2) == [2, 4]
    assert whole_prompt_rows(num_new, context, first=3) == [4]
    assert whole_prompt_rows([1, N], [N, N], first=0) == [1]  # a one-token row is never a long prompt


def test_padded_lengths_are_few_and_at_most_an_eighth_longer():
    """cuDNN builds a plan per shape: each octave's lengths pad to multiples of an eighth of its start."""
    for low in (1024, 4096, 65536):
        padded = {padded_length(n) for n in range(low, 2 * low)}
        assert padded == set(range(low, 2 * low + 1, low // 8))
    for n in list(range(1, 5000)) + [16000, 100_000]:
        assert n <= padded_length(n) <= n + n // 8
    assert padded_length(16000) == 16384 and padded_length(4096) == 4096


def test_the_planned_lengths_are_every_one_a_prompt_up_to_the_budget_takes():
    lengths = planned_lengths(8192)
    assert {padded_length(n) for n in range(CUDNN_MIN_TOKENS, 8193)} == set(lengths)
    assert lengths[0] == CUDNN_MIN_TOKENS and lengths[-1] == 8192 and len(lengths) <= 16
    assert planned_lengths(CUDNN_MIN_TOKENS - 1) == []


def test_serve_plans_the_lengths_its_budget_and_model_allow_before_the_first_request(monkeypatch):
    from types import SimpleNamespace

    from pagedcli.commands import serve

    asked, said = [], []
    monkeypatch.setattr(serve, "notice", said.append)
    for budget, max_model_len in ((8192, 131072), (16384, 4096)):
        backend = SimpleNamespace(plan_whole_prompts=lambda n: asked.append(n) or 7)
        engine = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(backend=backend)),
                                 scheduler=SimpleNamespace(max_num_batched_tokens=budget),
                                 cache=SimpleNamespace(max_model_len=max_model_len))
        serve.plan_long_prompts(engine)
    assert asked == [8192, 4096] and len(said) == 2 and "7 prompt lengths" in said[0]
    serve.plan_long_prompts(SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(backend=object()))))
    assert len(said) == 2  # the torch backend: nothing to plan, nothing said


def test_the_prefill_tiles_leave_out_the_sequences_cudnn_serves():
    num_new, context = [1, 300, 70, 500], [9, 300, 100, 500]
    seq, row, _, _, starts = prefill_tile_lists(num_new, context, rows=64, skip=1, elsewhere=[1, 3])
    assert sorted(zip(seq, row)) == [(2, 0), (2, 64)]
    assert starts == [0, 1, 301, 371]  # every sequence's first row, served here or not
    everything = prefill_tile_lists(num_new, context, rows=64, skip=1)[0]
    assert sorted(set(everything)) == [1, 2, 3]


def test_gathered_prompt_and_causal_product_are_the_torch_backends_attention():
    """A step of two whole prompts (shuffled blocks, scrambled slots, GQA 3) and a chunk after a
    cached prefix: for each whole prompt, gather_kv + the causal product, padded or not, equal the
    torch backend's rows of that prompt (same keys, same order, each query head on its own kv head)."""
    torch.manual_seed(0)
    config = make_config(6, 2, 16, torch.float32, max_len=256)
    block = 8
    geo = CacheGeometry.build(config, torch.float32, block, num_blocks=config.num_layers * 64)
    cache = KVCache(geo, 4, 256, device="cpu", shuffle_seed=5)
    cache.store.pool.copy_(torch.randn(cache.store.pool.shape))
    slots, num_new, cached = [3, 0, 2], [37, 50, 20], [0, 0, 30]
    for slot, n, c in zip(slots, num_new, cached):
        cache.grow(slot, n + c)
    cache.sync_device_table()
    assert len({int(b) for b in cache.store.device_table[3, 1, :5]}) == 5  # the prompt's blocks are scattered
    batch = StepBatch.build(True, slots, [[1] * n for n in num_new], cached, torch.device("cpu"))
    ref = TorchBackend(cache.store, config)
    ref.prepare(batch)
    q = torch.randn(sum(num_new), config.num_heads, config.head_dim)
    want = ref.attend(1, q, batch)
    first = 0
    for b, n in enumerate(num_new):
        if cached[b] == 0:
            k, v = gather_kv(cache.store, 1, batch.slots[b:b + 1], n)
            assert k.shape == (n, config.num_kv_heads, config.head_dim)
            for length in (n, n + 13, padded_length(n)):  # padded rows change no real one
                got = _causal(q[first:first + n], k, v, length)
                torch.testing.assert_close(got, want[first:first + n], atol=1e-5, rtol=1e-5)
                # gathered as `length` rows, zeros past n (the last block's stale rows too)
                k_rows, v_rows = gather_kv(cache.store, 1, batch.slots[b:b + 1], n, length)
                assert k_rows.shape == (length, config.num_kv_heads, config.head_dim) and k_rows.is_contiguous()
                assert torch.equal(k_rows[:n], k) and torch.equal(v_rows[:n], v)
                assert not k_rows[n:].any() and not v_rows[n:].any()
                torch.testing.assert_close(_causal(q[first:first + n], k_rows, v_rows, length), got)
        first += n
