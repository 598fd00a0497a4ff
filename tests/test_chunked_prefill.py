"""Chunked prefill: a step's token budget, decode tokens first, prompts in chunks. Whatever the
budget, greedy output is the unchunked output (and transformers'), block accounting holds at
every step, and a decoding sequence advances in every step that carries a prompt chunk."""

from __future__ import annotations

import json
import random

import pytest

from helpers import check_block_accounting, fake_gpu, invoke
from pagedcli.core.options import SamplingParams
from pagedcli.core.errors import UsageError
from test_oracle import assert_matches_hf

LENGTHS = [3, 40, 17, 75, 9, 33]  # several prompts longer than the small budgets, across block boundaries
BUDGETS = [2, 16, 37, 4096]  # 2: the least a batch of 2 allows; 4096: no prompt is ever split


def prompts(lengths, seed=0, vocab=200):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(engine, prompt_list, params, check=True):
    """Outputs in input order, checking the blocks after every step; also the steps' shapes."""
    seqs = [engine.add_request(p, params) for p in prompt_list]
    steps = []
    while engine.has_unfinished:
        out = engine.step()
        steps.append(out)
        if check:
            check_block_accounting(engine)
    return [s.output_token_ids for s in seqs], steps


def outputs(make_engine, model, prompt_list, params, **opts):
    return run(make_engine(model, **opts).engine, prompt_list, params)[0]


@pytest.mark.parametrize("budget", BUDGETS)
def test_any_budget_gives_the_unchunked_output(tiny, make_engine, budget):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = prompts(LENGTHS)
    unchunked = outputs(make_engine, tiny, ps, params, batch=2, chunked_prefill=False)
    engine = make_engine(tiny, batch=2, max_num_batched_tokens=budget).engine
    chunked, steps = run(engine, ps, params)
    assert chunked == unchunked
    assert all(out.num_tokens <= budget for out in steps)
    if budget < max(LENGTHS):
        assert any(out.prefilling for out in steps), "a prompt longer than the budget is split"
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks


def test_chunks_match_transformers(tiny, make_engine):
    loaded = make_engine(tiny, batch=3, max_num_batched_tokens=5)
    assert_matches_hf(loaded, tiny, prompts([1, 7, 16, 17, 45], seed=2, vocab=211), steps=6)


@pytest.mark.parametrize("model", ["stories", "demo"])
def test_trained_models_chunked_equal_unchunked(stories, make_engine, model):
    """stories260K and the demo model, with a shared prefix (prefix caching hits), budgets 3 and 13."""
    model = stories if model == "stories" else "demo"
    loaded = make_engine(model, batch=3, chunked_prefill=False)
    tok = loaded.tokenizer
    texts = ["Once upon a time, there was a little girl named Lily. She loved to play outside",
             "Once upon a time, there was a little girl named Lily. She had a red ball",
             "Tom and his dog went to the park to play with a big ball"]
    ps = [tok.encode(t) for t in texts] * 2
    params = SamplingParams(max_tokens=16)
    unchunked = run(loaded.engine, ps, params)[0]
    for budget in (3, 13):
        engine = make_engine(model, batch=3, max_num_batched_tokens=budget).engine
        assert run(engine, ps, params)[0] == unchunked
        assert engine.scheduler.cached_prompt_tokens > 0


def test_parallel_samples_under_chunks(tiny, make_engine):
    """--n: the children fork once their parent's last chunk is in, and draw what they draw unchunked."""
    params = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=10, ignore_eos=True) for i in range(3)]
    prompt = prompts([45])[0]
    runs = []
    for opts in (dict(chunked_prefill=False), dict(max_num_batched_tokens=4)):
        engine = make_engine(tiny, batch=4, **opts).engine
        engine.add_request(prompts([20], seed=5)[0], SamplingParams(max_tokens=12, ignore_eos=True))
        seqs = engine.add_parallel(prompt, params)
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        runs.append([s.output_token_ids for s in seqs])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1]}) > 1, "the samples differ from each other"


def test_preemption_under_a_tiny_pool(tiny, make_engine):
    """A pool too small for every sequence at once: preemptions (part-way prompts among them)
    recompute, and the output is what a large pool gives."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ps = prompts([20, 35, 12, 50], seed=4)
    roomy = outputs(make_engine, tiny, ps, params, batch=3, chunked_prefill=False)
    engine = make_engine(tiny, batch=3, num_blocks=2 * 8, max_num_batched_tokens=7).engine  # 8 blocks a layer
    tight, _ = run(engine, ps, params)
    assert tight == roomy
    assert engine.scheduler.num_preemptions > 0


def test_a_preempted_part_way_prompt_starts_again(tiny, make_engine):
    """A decoding sequence needs a block while a prompt behind it is part-way through its prefill:
    the prompt is preempted (it came last), gives its blocks back, and is prefilled again later."""
    params = SamplingParams(max_tokens=18, ignore_eos=True)  # 60 + 18 tokens: within the small pool's 80
    ps = [prompts([14])[0], prompts([60], seed=6)[0]]
    roomy = outputs(make_engine, tiny, ps, params, batch=2, chunked_prefill=False)
    engine = make_engine(tiny, batch=2, num_blocks=2 * 5, max_num_batched_tokens=4).engine  # 5 blocks a layer
    victims = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (victims.append((seq.id, seq.is_prefilling, seq.num_cached)), preempt(seq))
    assert run(engine, ps, params)[0] == roomy
    assert victims and victims[0][:2] == (1, True) and victims[0][2] > 0, victims


def test_decoding_never_waits_for_a_long_prompt(tiny, make_engine):
    """While a 90-token prompt is prefilled 6 tokens a step, the sequence already decoding gets a
    token in every one of those steps; the prompt's blocks are all held from admission and fill
    chunk by chunk."""
    engine = make_engine(tiny, batch=2, max_num_batched_tokens=7).engine
    short = engine.add_request(prompts([5])[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    long = engine.add_request(prompts([90], seed=1)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    cached, chunk_steps = [], 0
    while not long.output_token_ids:
        before = len(short.output_token_ids)
        out = engine.step()
        chunk_steps += 1
        assert len(short.output_token_ids) == before + 1, "the decoding sequence advanced"
        assert out.is_prefill and out.num_tokens <= 7
        assert out.num_decode == 1, "the step says which of its tokens were a decoding sequence's (bench counts them apart)"
        held = engine.cache.num_blocks_of_slot[long.slot]
        assert held == engine.cache.geometry.blocks_for(90), "every block of the prompt from admission on"
        cached.append(long.num_cached)
        check_block_accounting(engine)
    assert chunk_steps == 15  # ceil(90 / 6): 6 prompt tokens beside the one decode token
    assert cached[:-1] == list(range(6, 90, 6)), "each step computes one more chunk, nothing sampled"
    out = engine.step()
    assert not out.is_prefill, "once no prompt is part-way, steps are plain decodes again"


def test_no_decode_is_planned_ahead_of_a_chunk(tiny, make_engine):
    """The overlap's step ahead is for plain decodes only: refused while a prompt is part-way."""
    engine = make_engine(tiny, batch=2, max_num_batched_tokens=4).engine
    a = engine.add_request(prompts([3])[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add_request(prompts([30], seed=3)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    out = engine.step()  # a decodes, b's first chunk
    assert out.prefilling and a in out.seqs
    assert engine.scheduler.schedule_ahead([a]) == []
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks - (
        engine.cache.num_blocks_of_slot[a.slot] + engine.cache.num_blocks_of_slot[out.prefilling[0].slot]
    ) * engine.cache.geometry.num_layers, "no block taken for a step ahead"


def test_the_budget_must_hold_a_token_per_slot(tiny, make_engine):
    with pytest.raises(UsageError, match="below `batch` 4"):
        make_engine(tiny, batch=4, max_num_batched_tokens=3)
    make_engine(tiny, batch=4, max_num_batched_tokens=3, chunked_prefill=False)  # unchunked: any budget


GiB = 1 << 30
# (name, memory, default budget offline, serving): vLLM's get_batch_defaults
GPUS = [("NVIDIA H200", 141 * GiB, 16384, 8192),  # 70 GiB or more: the larger budgets
        ("NVIDIA H100 80GB HBM3", 79 * GiB, 16384, 8192),  # "80GB", a little under 80 GiB to torch
        ("NVIDIA A100-SXM4-80GB", 80 * GiB, 8192, 2048),  # as large, but an A100: the smaller ones
        ("NVIDIA L4", 24 * GiB, 8192, 2048)]  # under 70 GiB


@pytest.mark.parametrize("name, memory, offline, serving", GPUS)
def test_the_default_budget_follows_the_gpu_and_the_use(monkeypatch, name, memory, offline, serving):
    import torch

    from pagedcli.core.options import default_max_batched_tokens

    fake_gpu(monkeypatch, name, memory)
    cuda = torch.device("cuda")
    assert default_max_batched_tokens(cuda, serving=False) == offline
    assert default_max_batched_tokens(cuda, serving=True) == serving


def test_the_cpus_default_budget_asks_no_gpu(monkeypatch):
    import torch

    from pagedcli.core.options import default_max_batched_tokens

    def no_gpu(device=None):
        raise AssertionError("a CPU's budget read a GPU's properties")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    cpu = torch.device("cpu")
    assert default_max_batched_tokens(cpu, serving=False) == default_max_batched_tokens(cpu, serving=True) == 256


def test_an_explicit_budget_wins_and_the_default_holds_a_token_a_slot(monkeypatch):
    import torch

    from pagedcli.core.options import UNCHUNKED_MAX_BATCHED_TOKENS
    from pagedcli.core.options import EngineOptions

    fake_gpu(monkeypatch, "NVIDIA H200", 141 * GiB)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineOptions().batched_tokens(cuda) == 16384
    assert EngineOptions(serving=True).batched_tokens(cuda) == 8192
    for serving in (False, True):
        assert EngineOptions(max_num_batched_tokens=300, serving=serving).batched_tokens(cuda) == 300
        assert EngineOptions(max_num_batched_tokens=100, serving=serving).batched_tokens(cpu) == 100
    assert EngineOptions(batch=9000).batched_tokens(cuda) == 16384, "the default, above the slots"
    assert EngineOptions(batch=9000, serving=True).batched_tokens(cuda) == 9000, "a token a slot, above the server's 8192"
    assert EngineOptions(batch=300).batched_tokens(cpu) == 300, "a token a slot, above the CPU's 256"
    fake_gpu(monkeypatch, "NVIDIA L4", 24 * GiB)
    assert EngineOptions(batch=3000, serving=True).batched_tokens(cuda) == 3000
    assert EngineOptions(batch=3, chunked_prefill=False).batched_tokens(cuda) == UNCHUNKED_MAX_BATCHED_TOKENS
    assert EngineOptions(chunked_prefill=False, serving=True).batched_tokens(cpu) == UNCHUNKED_MAX_BATCHED_TOKENS


@pytest.mark.parametrize("model", ["random:llama-3.2-1b", "demo"])
def test_serve_loads_with_the_servers_budget_and_generate_without(monkeypatch, model):
    from pagedcli.commands.generate import load_for_text
    from pagedcli.commands.options import EngineFlags, RequestFlags
    from pagedcli.commands.serve import load_model

    asked = []

    class Loaded(Exception):  # stops each load once its options are seen
        pass

    def load(opts, *_):
        asked.append(opts)
        raise Loaded

    monkeypatch.setattr("pagedcli.engine.build.load", load)
    with pytest.raises(Loaded):
        load_model(EngineFlags(model=model), RequestFlags())
    with pytest.raises(Loaded):
        load_for_text(EngineFlags(model=model), RequestFlags(), "generate", None)
    assert [opts.serving for opts in asked] == [True, False]


def test_cli_views_a_prompt_part_way(stories):
    """inspect-cache --at-step stops in the middle of a prefill and says how far it got."""
    args = ["inspect-cache", "--model", str(stories), "--batch", "1", "--max-num-batched-tokens", "4", "--max-tokens",
            "3", "--at-step", "2", "Once upon a time, there was a little girl named Lily"]
    code, stdout, stderr = invoke(*args, "--json")
    assert code == 0, stderr
    view = json.loads(stdout)
    assert view["prefill"] == {"computed": 8, "of": len(view["prompt_token_ids"])}
    assert view["num_cached"] == 8 and not view["output_token_ids"]
    code, stdout, _ = invoke(*args)
    assert code == 0 and f"prefill 8/{len(view['prompt_token_ids'])}" in stdout


def test_live_view_draws_prefill_progress(tiny, make_engine):
    from rich.console import Console

    from pagedcli.console.drawing import render

    engine = make_engine(tiny, batch=1, max_num_batched_tokens=10).engine
    engine.add_request(prompts([35])[0], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    console = Console(width=160, record=True)
    console.print(render(engine.snapshot(), width=160))
    assert "prefill 10/35" in console.export_text()


def test_a_steps_new_tokens_are_sliced_across_prompt_and_output():
    from pagedcli.engine.sequence import Sequence

    seq = Sequence(0, [1, 2, 3, 4], SamplingParams())
    for token in (5, 6, 7):
        seq.append_token(token)
    assert len(seq) == 7
    for start in range(8):
        for stop in range(start, 8):
            assert seq.tokens_between(start, stop) == seq.token_ids[start:stop]


def test_a_mixed_step_puts_its_decoding_rows_first(tiny, make_engine):
    """Two samples of a short prompt fork once its prefill is in, the second joining the running
    list behind a long prompt admitted part-way in the same step: each mixed step still feeds the
    decoding sequences first, one token each, then the chunk (the CUDA backend's decode kernel
    serves the leading one-token rows as they lie); the output is the unchunked one."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    short, long = prompts([6])[0], prompts([60], seed=1)[0]

    def run_all(engine):
        seqs = engine.add_parallel(short, [params, params]) + [engine.add_request(long, params)]
        run(engine, [], params)  # to the end, the blocks checked after each step
        return [s.output_token_ids for s in seqs]

    engine = make_engine(tiny, batch=4, max_num_batched_tokens=8).engine
    plans, schedule = [], engine.scheduler.schedule

    def recorded():  # each step's new tokens, and which of its sequences were decoding
        plan = schedule()
        plans.append((plan.num_new, [not s.is_prefilling for s in plan.seqs]))
        return plan

    engine.scheduler.schedule = recorded
    assert run_all(engine) == run_all(make_engine(tiny, batch=4, chunked_prefill=False).engine)
    assert plans[0][0] == [6, 2], "the short prompt whole, the long one's first chunk"
    assert plans[1] == ([1, 1, 6], [True, True, False]), "the fork decodes beside its parent, ahead of the chunk"
    for num_new, decoding in plans:
        assert decoding == sorted(decoding, reverse=True), num_new
        assert num_new[:sum(decoding)] == [1] * sum(decoding)


def test_prefill_tiles_skip_the_leading_one_token_rows_and_cover_every_other_row():
    """cuda_launch's work list for a step of three one-token rows, then a 70-token chunk and a
    16-token prompt: the leading one-token rows (and only those) are left to the decode kernel,
    every other new row lies in exactly one tile, the longest-reaching tiles first."""
    from pagedcli.backends.cuda_launch import leading_single_rows, max_prefill_tiles, prefill_tile_lists

    num_new, context = [1, 1, 1, 70, 1, 16], [40, 9, 1, 170, 30, 16]
    d = leading_single_rows(num_new)
    assert d == 3 and leading_single_rows([5, 1]) == 0 and leading_single_rows([1, 1]) == 2
    seq, row, part, parts, starts = prefill_tile_lists(num_new, context, 32, skip=d)
    assert part == [0] * len(seq) and parts == [1] * len(seq), "no split asked for"
    assert starts == [0, 1, 2, 3, 73, 74]
    covered = sorted((b, r) for b, r0 in zip(seq, row) for r in range(r0, min(r0 + 32, num_new[b])))
    assert covered == [(3, r) for r in range(70)] + [(4, 0)] + [(5, r) for r in range(16)]
    reach = [context[b] - num_new[b] + r0 + min(32, num_new[b] - r0) for b, r0 in zip(seq, row)]
    assert reach == sorted(reach, reverse=True)
    assert len(seq) <= max_prefill_tiles(sum(num_new), len(num_new), 32)
    assert sorted(set(prefill_tile_lists(num_new, context, 32)[0])) == list(range(6)), "no skip: a tile each"


def test_prefill_tiles_split_the_longest_keys_until_the_list_fills_the_gpu():
    """Too few tiles to fill the GPU (a 100-token chat turn after 8,000 cached tokens, a 300-token
    chunk after 3,000 in 3 tiles, a short prompt): the longest tiles' keys are cut into parts until the list
    holds `split_tiles` entries. A tile's parts are consecutive and first, numbered 0 to parts - 1;
    each part has at least PREFILL_SPLIT_MIN_TILES of the key tiles that start at or before the
    tile's first row (so every row sees its part's first key); every row is still in exactly one
    tile; and where the tiles already fill the list nothing is split."""
    from pagedcli.backends.cuda_build import PREFILL_BLOCK_N, PREFILL_MAX_PARTS, PREFILL_SPLIT_MIN_TILES
    from pagedcli.backends.cuda_launch import max_prefill_tiles, prefill_tile_lists

    num_new, context, rows = [100, 300, 40], [8100, 3300, 40], 128
    lists = prefill_tile_lists(num_new, context, rows, split_tiles=12)
    assert len(lists.seq) == 12 <= max_prefill_tiles(sum(num_new), 3, rows, split_tiles=12)
    tiles = {}
    for i, (b, r, p, n) in enumerate(zip(lists.seq, lists.row, lists.part, lists.parts)):
        tiles.setdefault((b, r), []).append((i, p, n))
    for (b, r), entries in tiles.items():
        first = [i for i, _, _ in entries][0]
        assert [i for i, _, _ in entries] == list(range(first, first + len(entries))), "a tile's parts in a row"
        assert [p for _, p, _ in entries] == list(range(len(entries))) and {n for _, _, n in entries} == {len(entries)}
        lead = (context[b] - num_new[b] + r) // PREFILL_BLOCK_N + 1  # key tiles at or before the first row
        assert len(entries) == 1 or lead // len(entries) >= PREFILL_SPLIT_MIN_TILES
        assert len(entries) <= PREFILL_MAX_PARTS
    split = [n > 1 for n in lists.parts]
    assert split == sorted(split, reverse=True), "the split tiles come first (their scratch slots)"
    parts = {key: len(entries) for key, entries in tiles.items()}
    assert parts[(0, 0)] > parts[(1, 0)] > 1 and parts[(2, 0)] == 1, "the longest split most; 40 keys not at all"
    assert sum(parts.values()) == 12
    covered = sorted((b, x) for b, r in tiles for x in range(r, min(r + rows, num_new[b])))
    assert covered == [(b, x) for b in range(3) for x in range(num_new[b])]
    assert prefill_tile_lists(num_new, context, rows, split_tiles=5).parts == [1] * 5, "5 tiles fill 5 entries"
    assert prefill_tile_lists(num_new, context, rows).parts == [1] * 5


def test_prefill_tile_splits_stay_inside_the_scratch_and_cover_every_key():
    """Random steps (1 to 12 sequences, chunks of 1 to 3,000 after 0 to 20,000 cached, budgets 0 to
    40): the work list never has more split entries than `split_tiles` (the scratch's slots), nor
    more entries than max_prefill_tiles (a prefill graph's), and the parts of each tile cover its
    key tiles exactly once, each part starting at or before the tile's first row, as
    paged_prefill.cu cuts them."""
    import random

    from pagedcli.backends.cuda_build import PREFILL_BLOCK_N
    from pagedcli.backends.cuda_launch import max_prefill_tiles, prefill_tile_lists

    rng = random.Random(3)
    for _ in range(300):
        b = rng.randint(1, 12)
        num_new = [rng.choice([1, rng.randint(1, 300), rng.randint(1, 3000)]) for _ in range(b)]
        context = [n + rng.choice([0, rng.randint(0, 2000), rng.randint(0, 20000)]) for n in num_new]
        rows, split_tiles = rng.choice([64, 128]), rng.randint(0, 40)
        lists = prefill_tile_lists(num_new, context, rows, split_tiles=split_tiles)
        assert sum(n > 1 for n in lists.parts) <= split_tiles
        assert len(lists.seq) <= max_prefill_tiles(sum(num_new), b, rows, split_tiles)
        for i, (seq, row, part, parts) in enumerate(zip(lists.seq, lists.row, lists.part, lists.parts)):
            if part:
                continue
            assert lists.seq[i:i + parts] == [seq] * parts and lists.part[i:i + parts] == list(range(parts))
            first_pos = context[seq] - num_new[seq] + row
            keys = first_pos + min(rows, num_new[seq] - row)
            num_tiles, lead = -(-keys // PREFILL_BLOCK_N), first_pos // PREFILL_BLOCK_N + 1
            bounds = [p * lead // parts for p in range(parts)] + [num_tiles]  # the kernel's tile_begin, tile_end
            assert all(a < c for a, c in zip(bounds, bounds[1:])), "an empty part"
            assert all(a * PREFILL_BLOCK_N <= first_pos for a in bounds[:-1]), "a part after the first row"
