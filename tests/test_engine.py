"""Continuous batching, stopping, sampling and the block bookkeeping of the engine."""

from __future__ import annotations

import random


from helpers import check_block_accounting
from pagedcli.core.options import SamplingParams


def test_finished_slot_is_refilled_at_once(tiny, make_engine):
    """Batch 2, five prompts of different lengths: never more than two running; the step after a
    sequence finishes admits the next prompt into its slot."""
    loaded = make_engine(tiny, batch=2)
    engine = loaded.engine
    lengths = [3, 9, 4, 20, 6]  # max_tokens differ so sequences end at different steps
    seqs = [engine.add_request([5 + i] * 7, SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    refills = 0
    while engine.has_unfinished:
        slot_of = {s.id: s.slot for s in engine.scheduler.running}
        out = engine.step()
        assert len(engine.scheduler.running) <= 2
        check_block_accounting(engine)
        if out.finished and engine.scheduler.waiting:
            freed = {slot_of[s.id] for s in out.finished}
            nxt = engine.step()  # (with chunked prefill the others decode in the same step)
            admitted = {s.slot for s in nxt.seqs if s.id not in slot_of}
            assert nxt.is_prefill and admitted and admitted <= freed
            refills += 1
            check_block_accounting(engine)
    assert refills >= 2
    assert [len(s.output_token_ids) for s in seqs] == lengths
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks


def test_sequences_of_different_lengths_decode_in_one_pass(tiny, make_engine):
    loaded = make_engine(tiny, batch=3)
    engine = loaded.engine
    for n in (1, 17, 33):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # prefill of all three
    out = engine.step()
    assert not out.is_prefill and len(out.seqs) == 3


def test_stop_token_ends_a_sequence_and_is_not_returned(tiny, make_engine):
    loaded = make_engine(tiny, batch=1)
    engine = loaded.engine
    first = engine.run_to_completion([[7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    engine.scheduler.stop_ids = {first[2]}
    seq = engine.run_to_completion([[7, 8, 9]], SamplingParams(max_tokens=6))[0]
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == first[: first.index(first[2])]


def test_never_past_the_maximum_length(tiny, make_engine):
    loaded = make_engine(tiny, batch=1, max_model_len=40)
    seq = loaded.engine.run_to_completion([list(range(3, 33))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(seq) == 40 and seq.finish_reason == "length"


def test_prompt_longer_than_the_model_fails_alone(tiny, make_engine):
    loaded = make_engine(tiny, batch=2, max_model_len=32)
    engine = loaded.engine
    seqs = engine.run_to_completion([[5] * 10, [5] * 32, [6] * 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert seqs[1].finish_reason == "error" and "32 tokens" in seqs[1].error
    assert [len(s.output_token_ids) for s in (seqs[0], seqs[2])] == [4, 4]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny, make_engine):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)
    alone = make_engine(tiny, batch=1).engine.run_to_completion([[4, 5, 6]], params)[0].output_token_ids
    engine = make_engine(tiny, batch=3).engine
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=99)
    a = engine.add_request([9, 9], other)
    b = engine.add_request([4, 5, 6], params)
    while engine.has_unfinished:
        engine.step()
    assert b.output_token_ids == alone
    assert a.output_token_ids != alone


def test_sampling_limits(tiny, make_engine):
    engine = make_engine(tiny, batch=1).engine
    greedy = engine.run_to_completion([[4, 5, 6]], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_token_ids
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True, seed=1)
    assert engine.run_to_completion([[4, 5, 6]], top1)[0].output_token_ids == greedy
    narrow = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True, seed=1)
    assert engine.run_to_completion([[4, 5, 6]], narrow)[0].output_token_ids == greedy
    hot = [engine.run_to_completion([[4, 5, 6]], SamplingParams(temperature=5.0, max_tokens=10, ignore_eos=True, seed=s))[0]
           .output_token_ids for s in range(3)]
    assert len({tuple(h) for h in hot}) > 1


def test_a_temperature_near_zero_is_greedy(tiny, make_engine):
    """Dividing the logits by 1e-38 would overflow them to inf (and the draw to NaN)."""
    engine = make_engine(tiny, batch=1).engine
    greedy = engine.run_to_completion([[4, 5, 6]], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_token_ids
    tiny_t = SamplingParams(temperature=1e-38, max_tokens=10, ignore_eos=True, seed=1)
    assert engine.run_to_completion([[4, 5, 6]], tiny_t)[0].output_token_ids == greedy


def test_abort_between_scheduling_and_the_forward_pass_drops_queued_copies(tiny, make_engine, monkeypatch):
    """Ctrl-C after a step queued copy-on-write copies but before it ran them: aborting frees the
    blocks and forgets the copies, and the engine runs the next requests as a fresh one does."""
    loaded = make_engine(tiny, batch=2)
    engine = loaded.engine
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=s) for s in (1, 2)]
    engine.add_parallel([4, 5, 6], params)  # a 3-token prompt: both samples share its partial block
    engine.step()  # the prefill; the second sample forks
    run = engine.runner.execute

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    try:
        engine.step()  # both write into the shared block: one copy is queued, then the interrupt
    except KeyboardInterrupt:
        pass
    assert engine.cache.pending_copies
    engine.abort_all()
    assert not engine.cache.pending_copies and not engine.has_unfinished
    check_block_accounting(engine)
    monkeypatch.setattr(engine.runner, "execute", run)
    engine.reset()
    again = engine.run_to_completion([[7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    fresh = make_engine(tiny, batch=2).engine.run_to_completion([[7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert again == fresh[0].output_token_ids


def test_random_interleavings_keep_blocks_consistent(tiny, make_engine):
    """Many requests of random lengths through a small pool: the accounting holds at every step
    and every block comes back."""
    rng = random.Random(0)
    loaded = make_engine(tiny, batch=4, num_blocks=2 * 12)
    engine = loaded.engine
    for _ in range(12):
        engine.add_request([rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))],
                           SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    assert all(s.finish_reason == "length" for s in engine.sequences)


def test_step_batch_packs_its_index_lists_into_typed_views():
    """StepBatch.build packs every index list into one buffer (one host-to-device copy on a GPU):
    each view keeps its own dtype and values, empty lists included, and the views do not overlap."""
    import torch

    from pagedcli.core.batch import StepBatch

    batch = StepBatch.build(True, [5, 2, 7], [[11, 12, 13], [21], [31, 32]], [0, 4, 9], torch.device("cpu"),
                            [True, False, True])
    assert batch.token_ids.tolist() == [11, 12, 13, 21, 31, 32] and batch.token_ids.dtype == torch.int64
    assert batch.positions.tolist() == [0, 1, 2, 4, 9, 10]
    assert batch.token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert batch.last_index.tolist() == [2, 5]  # the middle sequence's chunk samples nothing
    assert batch.slots.tolist() == [5, 2, 7] and batch.slots.dtype == torch.int32
    assert batch.context_lens.tolist() == [3, 5, 11] and batch.context_lens.dtype == torch.int32
    batch.token_ids.fill_(-1)  # writing one view leaves the others as they were
    assert batch.positions.tolist() == [0, 1, 2, 4, 9, 10] and batch.slots.tolist() == [5, 2, 7]
    empty = StepBatch.build(True, [1], [[4]], [0], torch.device("cpu"), [False])
    assert empty.last_index.tolist() == [] and empty.last_index.dtype == torch.int64
