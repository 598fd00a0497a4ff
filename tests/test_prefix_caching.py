"""Shared blocks: prefix caching and copy-on-write for parallel samples."""

from __future__ import annotations

import random

import pytest

from helpers import check_block_accounting, invoke
from pagedcli.core.options import SamplingParams
from test_oracle import assert_matches_hf

SYSTEM = list(range(40, 40 + 37))  # a shared 37-token prefix: two full blocks of 16 and a partial one


def prompts_with_shared_prefix(n, seed=0):
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def run(engine, prompts, params):
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    return [s.output_token_ids for s in seqs]


def test_prefix_hits_change_nothing_but_the_work(tiny, make_engine):
    prompts = prompts_with_shared_prefix(6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cached = make_engine(tiny, batch=2).engine
    plain = make_engine(tiny, batch=2, prefix_caching=False).engine
    assert run(cached, prompts, params) == run(plain, prompts, params)
    # the first two prompts are prefilled together, so both compute the prefix; the four after
    # them find its two full blocks
    assert cached.scheduler.cached_prompt_tokens == 4 * 32
    assert cached.scheduler.prefix_hit_rate == pytest.approx(4 * 32 / sum(map(len, prompts)))
    assert plain.scheduler.prefix_hit_rate == 0
    assert (cached.cache.allocator.ref_count == 0).all(), "reference counts return to zero"


def test_prefix_hits_match_transformers(tiny, make_engine):
    loaded = make_engine(tiny, batch=3)
    assert_matches_hf(loaded, tiny, prompts_with_shared_prefix(5, seed=3), steps=10)
    assert loaded.engine.scheduler.cached_prompt_tokens > 0


def test_a_whole_cached_prompt_still_computes_its_last_token(tiny, make_engine):
    engine = make_engine(tiny, batch=1).engine
    prompt = list(range(50, 82))  # exactly two blocks
    first = run(engine, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    again = run(engine, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    assert first == again
    assert engine.scheduler.cached_prompt_tokens == 16  # one block reused; the last is recomputed


def test_freed_cached_blocks_are_evicted_least_recently_used(tiny, make_engine):
    layers = 2
    engine = make_engine(tiny, batch=1, num_blocks=layers * 8).engine  # room for 8 blocks a layer
    a, b = list(range(10, 43)), list(range(100, 133))  # 33 tokens: 2 full blocks + 1
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    run(engine, [a], params)
    run(engine, [b], params)  # a's cached blocks are older than b's: freed first, reused first
    run(engine, [list(range(150, 190))], params)  # needs 3 blocks a layer: evicts a's, keeps b's
    hits = engine.scheduler.cached_prompt_tokens
    run(engine, [b], params)
    assert engine.scheduler.cached_prompt_tokens == hits + 32, "b's blocks survived"
    hits = engine.scheduler.cached_prompt_tokens
    run(engine, [a], params)
    assert engine.scheduler.cached_prompt_tokens == hits, "a's blocks were evicted"


def test_the_prefix_cache_keeps_the_first_writer_and_forgets_a_row_by_any_of_its_blocks():
    """PrefixCache's rows (a physical block per layer) as the allocator reuses blocks: a hash known
    already, or a row with a block another row holds (or an earlier row of the same call), stays
    private; reusing any one block of a row drops the whole row, and only it; the longest known run
    is found from the start."""
    import numpy as np

    from pagedcli.engine.prefix_cache import PrefixCache

    cache = PrefixCache(12)
    cache.insert([7, 8, 9], np.array([[0, 1], [2, 3], [4, 5]]))
    cache.insert([8, 10, 11], np.array([[6, 7], [3, 8], [9, 10]]))  # 8: known; 10: block 3 is 8's
    assert sorted(cache.rows) == [7, 8, 9, 11]
    assert [r.tolist() for r in cache.lookup([7, 8, 10, 11], 4)] == [[0, 1], [2, 3]], "stops at the unknown 10"
    assert len(cache.lookup([7, 8, 9], 2)) == 2, "at most the limit"
    cache.forget(np.array([5, 10, 6]))  # 9's and 11's rows; 6 and 7 were never held (10's stayed private)
    assert sorted(cache.rows) == [7, 8]
    assert cache.held.nonzero()[0].tolist() == [0, 1, 2, 3]
    cache.insert([9], np.array([[4, 11]]))  # block 4 is free of rows again: 9 can be cached anew
    assert cache.lookup([7, 8, 9], 3)[2].tolist() == [4, 11]
    # in one call (every sequence's new block of a decode step): a duplicate hash stays private, and
    # so does a row that shares a block with an earlier row of the call (kept or not)
    cache.insert([20, 20, 21, 22], np.array([[5, 6], [10, 6], [6, 10], [10, 11]]))
    assert cache.lookup([20], 1)[0].tolist() == [5, 6]
    assert 21 not in cache.rows and 22 not in cache.rows
    assert cache.held.nonzero()[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 11]


def test_every_sequence_of_a_step_offers_the_block_it_completed(tiny, make_engine):
    """Three sequences complete their first block in the same decode step, and the step offers all
    three to the prefix cache (KVCache.register takes the step's sequences at once): prompts that
    repeat each one's first 17 tokens then find 16 of them cached."""
    engine = make_engine(tiny, batch=3).engine
    seqs = engine.run_to_completion([[10 + i] * 10 for i in range(3)], SamplingParams(max_tokens=12, ignore_eos=True))
    before = engine.scheduler.cached_prompt_tokens
    engine.run_to_completion([s.token_ids[:17] for s in seqs], SamplingParams(max_tokens=1, ignore_eos=True))
    assert engine.scheduler.cached_prompt_tokens - before == 3 * 16


@pytest.mark.parametrize("prompt_len", [37, 32])  # a shared partial block, and none
def test_parallel_samples_share_blocks_and_equal_unshared_runs(tiny, make_engine, prompt_len):
    prompt = list(range(20, 20 + prompt_len))
    params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=20, ignore_eos=True, seed=100 + j)
              for j in range(4)]
    engine = make_engine(tiny, batch=4).engine
    seqs = engine.add_parallel(prompt, params)
    peak_used = 0
    while engine.has_unfinished:
        out = engine.step()
        peak_used = max(peak_used, out.used_blocks)
        check_block_accounting(engine)
    shared = [s.output_token_ids for s in seqs]
    alone = make_engine(tiny, batch=1, prefix_caching=False).engine
    unshared = [alone.run_to_completion([prompt], p)[0].output_token_ids for p in params]
    assert shared == unshared
    assert len({tuple(s) for s in shared}) > 1, "different seeds should sample differently"
    layers = 2
    if prompt_len % 16:
        assert engine.cache.num_copied_blocks == 3 * layers, "three children copied the shared partial block"
    else:
        assert engine.cache.num_copied_blocks == 0
    assert (engine.cache.allocator.ref_count == 0).all()


def test_parallel_samples_wait_for_a_slot_when_the_batch_is_full(tiny, make_engine):
    prompt = list(range(20, 57))
    params = [SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=j) for j in range(3)]
    engine = make_engine(tiny, batch=2).engine
    seqs = engine.add_parallel(prompt, params)
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    alone = make_engine(tiny, batch=1, prefix_caching=False).engine
    assert [s.output_token_ids for s in seqs] == [alone.run_to_completion([prompt], p)[0].output_token_ids for p in params]
    assert engine.scheduler.cached_prompt_tokens >= 32  # the third sample found the prompt's full blocks


def test_preemption_with_shared_blocks_keeps_accounting(tiny, make_engine):
    rng = random.Random(5)
    engine = make_engine(tiny, batch=4, num_blocks=2 * 12).engine
    for i in range(5):
        prompt = SYSTEM[:20] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 10))]
        engine.add_parallel(prompt, [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=i * 10 + j)
                                     for j in range(2)])
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.scheduler.num_preemptions > 0
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 30 for s in engine.sequences)
    assert (engine.cache.allocator.ref_count == 0).all()


# --- as a user sees it -----------------------------------------------------------------------------
def cli(*args):
    code, stdout, stderr = invoke(*args)
    assert code == 0, stderr
    return stdout


def test_generate_n_answers_share_and_equal_separate_seeded_runs(stories):
    import json

    shared = [json.loads(line) for line in cli("generate", "--model", str(stories), "--json", "--n", "3", "--batch",
                                               "3", "--temperature", "0.9", "--seed", "4", "--max-tokens", "15",
                                               "Once upon a time").splitlines()]
    assert [r["sample"] for r in shared] == [0, 1, 2]
    for j, record in enumerate(shared):
        alone = json.loads(cli("generate", "--model", str(stories), "--json", "--temperature", "0.9", "--seed",
                               str(4 + j), "--max-tokens", "15", "--no-prefix-caching", "Once upon a time"))
        assert record["token_ids"] == alone["token_ids"]


def test_inspect_cache_json_has_reference_counts(stories):
    import json

    out = json.loads(cli("inspect-cache", "--model", str(stories), "--json", "--n", "2", "--batch", "2",
                         "--temperature", "1", "--seed", "1", "--max-tokens", "30", "--slot", "1", "--at-step", "1",
                         "One day, Lily went to the park with her mom and"))
    blocks = out["layers"][0]["blocks"]
    assert all(b["ref_count"] == 2 for b in blocks), "right after the fork both samples hold every block"
    assert all(b["ref_count"] == 1 + len(b["shared_with"]) for layer in out["layers"] for b in layer["blocks"])


def test_bench_reports_the_hit_rate_and_ttft_without_the_cache(stories):
    import json

    row = json.loads(cli("bench", "--model", str(stories), "--json", "--batch", "2", "--num-prompts", "6",
                         "--input-len", "40", "--prefix-len", "32", "--output-len", "4", "--bandwidth", "10"))
    assert 0 < row["prefix_cache_hit_rate"] <= 32 / 40
    assert set(row["ttft_ms_without_prefix_cache"]) == {"mean", "p50", "p99"}
