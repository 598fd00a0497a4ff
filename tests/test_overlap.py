"""The engine's overlap: the next decode step is queued before this one's tokens reach the host.

On a GPU that hides the host's work; here on the CPU the same planning runs (forced on), so these
tests check what it must never change: the tokens, the stopping, the block bookkeeping."""

from __future__ import annotations

import random

import pytest

from helpers import check_block_accounting
from pagedcli.core.options import SamplingParams


def run(make_engine, folder, prompts, params, overlap, stop_ids=(), **opts):
    engine = make_engine(folder, **opts).engine
    engine.overlap = overlap
    engine.scheduler.stop_ids |= set(stop_ids)
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_unfinished:
        out = engine.step()
        check_block_accounting(engine)
        assert all(not s.is_finished or s in out.finished for s in out.seqs), "a finished sequence stepped again"
    assert engine.in_flight is None
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks, "blocks leaked"
    return [(s.output_token_ids, s.finish_reason) for s in seqs], engine


def prompts_and_params(n, seed, stop=False):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=not stop) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("batch, num_blocks", [(3, None), (4, 2 * 9)], ids=["refills", "pool-runs-out"])
def test_overlap_changes_no_token(tiny, make_engine, batch, num_blocks):
    """Sequences of different lengths that end at different steps (their length, or a stop token
    seen only after the next step was queued), more prompts than slots (so admissions wait for a
    step in flight), and a pool small enough to preempt."""
    prompts, params = prompts_and_params(12, seed=batch, stop=True)
    free_run, _ = run(make_engine, tiny, prompts, params, False, batch=batch)
    # stop tokens: what every third answer samples at its fourth step (steps were queued ahead of it)
    stop_ids = {tokens[3] for tokens, _ in free_run[::3] if len(tokens) > 3}
    plain, _ = run(make_engine, tiny, prompts, params, False, stop_ids, batch=batch, num_blocks=num_blocks)
    overlapped, engine = run(make_engine, tiny, prompts, params, True, stop_ids, batch=batch, num_blocks=num_blocks)
    assert overlapped == plain
    assert {"stop", "length"} <= {reason for _, reason in plain}
    assert engine.num_launched_ahead > engine.num_steps // 2, "most decode steps should be queued ahead"
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to run out"


def test_a_stop_token_in_flight_drops_the_step_ahead(tiny, make_engine):
    """A stop token is only seen after the next step was queued: that step's token for the
    sequence is dropped, its block goes back, and the others go on unchanged."""
    prompts = [[7, 8, 9], [11, 12, 13, 14], list(range(20, 37))]
    free_run, _ = run(make_engine, tiny, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 3, False, batch=3)
    answers = [tokens for tokens, _ in free_run]
    # a token that one answer first samples at a decode step (index >= 2: a step is queued ahead
    # of it) and that no other answer ever samples
    i, k = next((i, k) for i, a in enumerate(answers) for k in range(2, len(a))
                if a[k] not in a[:k] and not any(a[k] in b for j, b in enumerate(answers) if j != i))
    stop = answers[i][k]
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny, batch=3).engine
        engine.scheduler.stop_ids = {stop}
        engine.overlap = overlap
        seqs = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        results.append([(s.output_token_ids, s.finish_reason) for s in seqs])
    assert results[0] == results[1]
    assert results[1][i] == (answers[i][:k], "stop")
    assert [r for j, r in enumerate(results[1]) if j != i] == [(a, "length") for j, a in enumerate(answers) if j != i]


def test_overlap_with_parallel_samples_and_seeds(tiny, make_engine):
    """Forked samples share blocks (copy-on-write) and draw with their own seeded generators: the
    step ahead must copy before it writes and keep each generator's order."""
    outs = []
    for overlap in (False, True):
        engine = make_engine(tiny, batch=4).engine
        engine.overlap = overlap
        params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=18, seed=i, ignore_eos=True) for i in range(3)]
        seqs = engine.add_parallel(list(range(30, 53)), params)  # 23 tokens: the last block is shared and partial
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.cache.num_copied_blocks > 0
        outs.append([s.output_token_ids for s in seqs])
    assert outs[0] == outs[1]


def test_nothing_is_queued_ahead_of_an_admission(tiny, make_engine):
    """With a request waiting for a slot, the step after a finish is its prefill, not a decode
    queued ahead: continuous batching stays first come, first served."""
    engine = make_engine(tiny, batch=1).engine
    engine.overlap = True
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    b = engine.add_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    kinds = []
    while engine.has_unfinished:
        out = engine.step()
        kinds.append(("prefill" if out.is_prefill else "decode", [s.id for s in out.seqs]))
    assert kinds == [("prefill", [a.id])] + [("decode", [a.id])] * 3 + [("prefill", [b.id])] + [("decode", [b.id])] * 2


def test_a_slot_freed_by_length_is_refilled_at_once(tiny, make_engine):
    """A sequence that reaches its length with the step in flight is known to end: no step is
    queued ahead of the waiting request's prefill, so it is admitted when it would be without the
    overlap (a stop token can only be seen a step late)."""
    kinds = []
    for overlap in (False, True):
        engine = make_engine(tiny, batch=2).engine
        engine.overlap = overlap
        ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)).id
               for p, n in (([5, 6, 7], 3), ([9, 10], 12), ([8, 9], 4))]
        steps = []
        while engine.has_unfinished:
            out = engine.step()
            steps.append(("prefill" if out.is_prefill else "decode", [ids.index(s.id) for s in out.seqs]))
        kinds.append(steps)
    assert kinds[1] == kinds[0]
    # (chunked prefill: sequence 1 decodes in the step that prefills 2)
    assert kinds[0][:4] == [("prefill", [0, 1]), ("decode", [0, 1]), ("decode", [0, 1]), ("prefill", [1, 2])]


def test_the_last_sequence_stopping_voids_the_step_ahead(tiny, make_engine):
    """When a stop token ends every sequence of the step queued ahead, nothing is left in flight:
    the engine is idle, every block is back, and the next run starts clean."""
    engine = make_engine(tiny, batch=1).engine
    engine.overlap = True
    free_run = engine.run_to_completion([[11, 12, 13, 14]], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_token_ids
    k = next(k for k in range(2, len(free_run)) if free_run[k] not in free_run[:k])
    engine.reset()
    engine.scheduler.stop_ids = {free_run[k]}
    seq = engine.add_request([11, 12, 13, 14], SamplingParams(max_tokens=12))
    while engine.has_unfinished:
        out = engine.step()
        if out.finished:
            assert engine.in_flight is None, "the step ahead of the stop was kept"
    assert seq.output_token_ids == free_run[:k] and seq.finish_reason == "stop"
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    engine.reset()
    assert engine.run_to_completion([[11, 12, 13, 14]], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_token_ids == free_run


def test_abort_with_a_step_in_flight(tiny, make_engine):
    """Ctrl-C while a step is queued ahead: every request ends, every block comes back, and the
    engine runs the next requests as a fresh one would."""
    engine = make_engine(tiny, batch=2).engine
    engine.overlap = True
    for p in ([5, 6, 7], list(range(10, 30))):
        engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.in_flight is not None
    engine.abort_all()
    assert engine.in_flight is None and not engine.has_unfinished
    assert all(s.finish_reason == "abort" for s in engine.sequences)
    check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    engine.reset()
    again = engine.run_to_completion([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    assert again == make_engine(tiny, batch=2).engine.run_to_completion([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids


@pytest.mark.parametrize("seed", range(8))
def test_overlap_on_random_workloads(tiny, make_engine, seed):
    """Random batch sizes, pools, length limits, prefix caching, stop tokens and forked samples:
    the overlap changes no token and no finish reason, and leaves every block accounted for."""
    rng = random.Random(seed)
    opts = dict(batch=rng.randint(1, 5), num_blocks=2 * rng.randint(6, 20), max_model_len=rng.choice([None, 40]),
                prefix_caching=rng.random() < 0.5)
    shared = [rng.randrange(3, 200) for _ in range(rng.randrange(0, 20))]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randint(3, 7))]
    params = [SamplingParams(max_tokens=rng.randrange(1, 25), temperature=rng.choice([0.0, 0.8]), seed=i)
              for i in range(len(prompts))]
    stops = {rng.randrange(3, 200) for _ in range(3)}
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny, **opts).engine
        engine.overlap = overlap
        engine.scheduler.stop_ids = stops
        seqs = [engine.add_request(p, q) for p, q in zip(prompts[1:], params[1:])]
        seqs += engine.add_parallel(prompts[0], [params[0], SamplingParams(**{**params[0].__dict__, "seed": 99})])
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.in_flight is None
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        results.append([(s.output_token_ids, s.finish_reason) for s in seqs])
    assert results[1] == results[0]


def test_no_step_is_queued_ahead_into_a_full_pool(tiny, make_engine):
    """Two sequences fill the pool exactly, then both cross a block boundary: the step ahead would
    need blocks that are not free, so it is not queued; the engine waits and preempts as it does
    without the overlap, with the same tokens."""
    prompts = [list(range(3, 19)), list(range(30, 46))]  # one full block each
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 2
    plain, _ = run(make_engine, tiny, prompts, params, False, batch=2, num_blocks=2 * 4)  # 4 blocks a layer
    overlapped, engine = run(make_engine, tiny, prompts, params, True, batch=2, num_blocks=2 * 4)
    assert overlapped == plain
    assert engine.scheduler.num_preemptions > 0
