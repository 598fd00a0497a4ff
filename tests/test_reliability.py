"""A full pool, preemption, and random interleavings: nobody's work is lost or corrupted."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import blocks_of, check_block_accounting
from pagedcli.engine.cache import KVCache
from pagedcli.model.config import ModelConfig
from pagedcli.core.geometry import CacheGeometry
from pagedcli.engine.scheduler import Scheduler
from pagedcli.engine.sequence import Sequence, Status
from pagedcli.core.options import SamplingParams

import torch


def run_alone(make_engine, folder, prompts, params_list):
    engine = make_engine(folder, batch=1).engine  # one slot: every request runs by itself
    seqs = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    while engine.has_unfinished:
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_full_pool_preempts_and_recomputes_without_changing_outputs(tiny, make_engine):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 6
    layers = 2
    engine = make_engine(tiny, batch=4, num_blocks=layers * 10).engine  # 160 tokens for 4 sequences of ~70
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
    assert [s.output_token_ids for s in seqs] == run_alone(make_engine, tiny, prompts, params)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks


def test_a_request_larger_than_the_pool_fails_alone(tiny, make_engine):
    engine = make_engine(tiny, batch=2, num_blocks=2 * 4).engine  # 64 tokens per layer in all
    seqs = engine.run_to_completion([[5] * 10, [6] * 70, [7] * 12], SamplingParams(max_tokens=5, ignore_eos=True))
    assert seqs[1].finish_reason == "error" and "`cache_size`" in seqs[1].error
    assert [len(seqs[0].output_token_ids), len(seqs[2].output_token_ids)] == [5, 5]


def test_soak_200_requests_through_a_small_pool(tiny, make_engine):
    """200 requests of random lengths, batch 8, a pool that forces preemptions: every request
    completes with the greedy output it gets when it runs alone."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 48))] for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True) for _ in range(200)]
    engine = make_engine(tiny, batch=8, num_blocks=2 * 14).engine
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if steps % 10 == 0:
            check_block_accounting(engine)
    assert engine.scheduler.num_preemptions > 0
    assert all(s.finish_reason == "length" for s in seqs)
    assert [s.output_token_ids for s in seqs] == run_alone(make_engine, tiny, prompts, params)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks


# --- property test of the allocator, the block table and the scheduler ----------------------------
CONFIG = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                     num_kv_heads=1, head_dim=4, max_position_embeddings=64)

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40)),
    st.tuples(st.just("step"), st.integers(0, 2**16)),
    st.tuples(st.just("finish"), st.integers(0, 2**16)),
    st.tuples(st.just("preempt"), st.integers(0, 2**16)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(3, 12), st.sampled_from([4, 8, 16]), st.integers(1, 4), st.one_of(st.none(), st.integers(0, 9)))
def test_random_interleavings_keep_every_block_accounted_for(operations, blocks_per_layer, block_size, slots, chunk):
    """`chunk`: None, no chunked prefill; else a budget of that many tokens beyond one a slot."""
    geometry = CacheGeometry(block_size, 1, 4, CONFIG.num_layers, blocks_per_layer * CONFIG.num_layers, torch.float32)
    cache = KVCache(geometry, slots, max_model_len=64, shuffle_seed=0)
    sched = Scheduler(cache, stop_ids=set(), max_num_batched_tokens=None if chunk is None else slots + chunk,
                      chunked_prefill=chunk is not None)
    seqs = []

    class Engine:  # what check_block_accounting reads
        pass

    view = Engine()
    view.cache, view.scheduler = cache, sched
    for op, arg in operations:
        if op == "add":
            seq = Sequence(len(seqs), [1] * arg, SamplingParams(max_tokens=10**6, ignore_eos=True))
            seqs.append(seq)
            sched.add(seq)
        elif op == "step":
            plan = sched.schedule()
            assert sum(plan.num_new) <= sched.max_num_batched_tokens or not sched.chunked_prefill
            for seq in plan.seqs:  # as after a forward pass: everything fed is cached, one token sampled
                assert cache.num_blocks_of_slot[seq.slot] * block_size >= len(seq)
            samples = plan.samples  # (a prompt chunk short of the prompt's end samples nothing)
            sched.advance([s for s, ok in zip(plan.seqs, samples) if not ok],
                          [n for n, ok in zip(plan.num_new, samples) if not ok])
            batch = [s for s, ok in zip(plan.seqs, samples) if ok]
            sched.update(batch, [arg % 7 + 2] * len(batch))
        elif op == "finish" and sched.running:
            sched.finish(sched.running[arg % len(sched.running)])
        elif op == "preempt" and sched.running:
            sched._preempt(sched.running.pop(arg % len(sched.running)))
        check_block_accounting(view)
        for seq in sched.running:
            for layer in range(CONFIG.num_layers):
                assert all(b >= 0 for b in blocks_of(cache, seq.slot, layer))
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq)
    sched.waiting.clear()
    check_block_accounting(view)
    assert sorted(cache.allocator.free) == list(range(geometry.num_blocks)), "the free list is not whole again"
    assert all(s.status in (Status.FINISHED,) for s in seqs if s.status is not Status.WAITING)


cache_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), max_size=4)),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 3)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(cache_ops, st.sampled_from([4, 16]))
def test_writes_prepared_together_take_the_blocks_one_at_a_time_would_and_reach_the_mirror(operations, block_size):
    """prepare_writes() for several slots (the engine's step ahead at a block boundary) takes the
    blocks, copies-on-write and marks the table's changes as prepare_write() one slot at a time
    does; and the marked entries, copied to a mirror (what sync_device_table sends a GPU), bring it
    level with the table after any mix of writes, releases and forks."""
    geometry = CacheGeometry(block_size, 1, 4, CONFIG.num_layers, 400 * CONFIG.num_layers, torch.float32)
    together, alone = (KVCache(geometry, 4, max_model_len=64, shuffle_seed=3) for _ in range(2))
    together.tracks_changes = True  # marks its changes for a mirror (another rank's, or a GPU's)
    mirror = together.table.copy()
    for op, *args in operations:
        if op == "write":  # each slot's next `grow` tokens, as a decode step ahead asks for them
            writes, seen = [], set()
            for slot, grow in args[0]:
                if slot not in seen and len(writes) < 4:
                    seen.add(slot)
                    writes.append((slot, min(64, together.num_blocks_of_slot[slot] * block_size + grow)))
            together.prepare_writes(writes)
            for slot, n in writes:
                alone.prepare_write(slot, n)
        elif op == "release":
            together.release(args[0])
            alone.release(args[0])
        elif op == "fork" and args[0] != args[1] and together.num_blocks_of_slot[args[1]] == 0:
            together.fork(*args)
            alone.fork(*args)
        assert (together.table == alone.table).all() and together.allocator.free == alone.allocator.free
        assert [(a.tolist(), b) for a, b in together.pending_copies] == [(a.tolist(), b) for a, b in alone.pending_copies]
        if together._changed:
            index = together._changed_indices()
            together._changed.clear()
            mirror.ravel()[index] = together.table.ravel()[index]
        assert (mirror == together.table).all(), "a changed entry of the table did not reach the mirror"

@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["allocate", "release", "share"]), st.integers(0, 10_000)),
                    max_size=120),
       num_blocks=st.integers(1, 40), seed=st.one_of(st.none(), st.integers(0, 5)))
def test_the_free_list_is_a_queue_of_least_recently_freed_blocks(ops, num_blocks, seed):
    """BlockAllocator against a plain model of its free list (an OrderedDict: taken from the front,
    freed to the back, a block a prefix shares taken out wherever it is): the same blocks handed
    out in the same order, the same free list after every operation (a queue with stale entries
    in it, squeezed out as it fills: many operations on a few blocks squeeze it often)."""
    from collections import OrderedDict

    from pagedcli.engine.cache import BlockAllocator

    allocator = BlockAllocator(num_blocks, shuffle_seed=seed)
    order = list(range(num_blocks))
    if seed is not None:
        random.Random(seed).shuffle(order)
    free, owners = OrderedDict.fromkeys(order), [0] * num_blocks
    for op, x in ops:
        if op == "allocate":
            n = x % (len(free) + 1)  # (none, too)
            want = [free.popitem(last=False)[0] for _ in range(n)]
            for b in want:
                owners[b] = 1
            assert allocator.allocate(n) == want
        elif op == "release" and any(owners):
            owned = [b for b in range(num_blocks) if owners[b]]
            blocks = [owned[(x + 7 * i) % len(owned)] for i in range(1 + x % 3)]
            blocks = [b for b in blocks if owners[b] >= blocks.count(b)]  # (a block twice, if it has two owners)
            for b in blocks:
                owners[b] -= 1
                if owners[b] == 0:
                    free[b] = None
            allocator.release(blocks)
        elif op == "share":
            b = x % num_blocks
            if owners[b] == 0:
                del free[b]
            owners[b] += 1
            allocator.share([b])
        assert allocator.free == list(free) and allocator.num_free == len(free)
        assert allocator.head <= allocator.tail <= len(allocator.queue), "stale entries are squeezed out in time"
        assert allocator.ref_count.tolist() == owners


def test_the_free_list_gives_the_garbage_collector_nothing_to_walk():
    """A pool sized to a GPU has millions of blocks: the allocator keeps them in arrays, not in a
    container the collector walks at every full collection (an OrderedDict of 4 million blocks
    took 140 ms a collection)."""
    import gc

    from pagedcli.engine.cache import BlockAllocator

    allocator = BlockAllocator(50_000, shuffle_seed=1)
    allocator.release(allocator.allocate(20_000)[::-1])
    walked = [name for name, value in vars(allocator).items() if len(gc.get_referents(value)) >= 1_000]
    assert not walked, f"containers the collector walks, one entry a block: {walked}"
    assert allocator.num_free == 50_000 and sorted(allocator.free) == list(range(50_000))
