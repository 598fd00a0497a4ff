"""vLLM's sampling and output options: repetition / presence / frequency penalties, min-p, stop
strings and logprobs. Each logits processor against transformers' (or OpenAI's formula), then
end to end through `pagedcli generate`, with the overlap, parallel samples and prefix caching."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from helpers import assert_one_line, check_block_accounting, hf_model, invoke
from pagedcli.commands.generate import add_requests
from pagedcli.engine.logits_processors import apply_min_p, apply_penalties, warp
from pagedcli.core.options import SamplingParams

STORY_PROMPT = "Once upon a time"


def random_logits(rows=3, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


# --- each processor, same logits in, same distribution out ---------------------------------------
def test_repetition_penalty_is_transformers():
    logits = random_logits()
    ids = torch.tensor([[3, 7, 7, 12, 40], [0, 1, 2, 3, 4], [49, 49, 49, 20, 5]])
    prompt, output = ids[:, :3], ids[:, 3:]  # the penalty looks at both
    prompt_mask = torch.zeros_like(logits, dtype=torch.bool).scatter(1, prompt, True)
    ones = torch.ones_like(output, dtype=torch.int32)
    counts = torch.zeros_like(logits, dtype=torch.int32).scatter_add(1, output, ones)
    for penalty in (1.3, 0.7):
        ours = apply_penalties(logits, prompt_mask, counts, torch.full((3,), penalty), torch.zeros(3), torch.zeros(3))
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(ours, theirs)
        assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_are_openais_formula():
    """logit[j] - count[j] * frequency - [count[j] > 0] * presence, on output tokens only."""
    logits = random_logits(rows=2)
    outputs, prompts = [[4, 4, 4, 9], [1, 30]], [[9, 11], [2]]
    presence, frequency = torch.tensor([0.5, -1.0]), torch.tensor([0.3, 2.0])
    prompt_mask = torch.zeros_like(logits, dtype=torch.bool)
    counts = torch.zeros_like(logits, dtype=torch.int32)
    expected = logits.clone()
    for r, (out, prompt) in enumerate(zip(outputs, prompts)):
        prompt_mask[r, prompt] = True
        for j in set(out):
            counts[r, j] = out.count(j)
            expected[r, j] -= out.count(j) * frequency[r] + presence[r]
    ours = apply_penalties(logits, prompt_mask, counts, torch.ones(2), presence, frequency)
    torch.testing.assert_close(ours, expected)


def distribution(logits):
    return logits.softmax(-1)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_is_transformers(min_p):
    logits = random_logits(rows=4, vocab=80, seed=1)
    theirs = MinPLogitsWarper(min_p)(None, logits.clone())
    torch.testing.assert_close(distribution(apply_min_p(logits, min_p)), distribution(theirs))


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 10, 1.0), (0.9, 0, 0.8), (1.1, 20, 0.6)])
def test_temperature_top_k_top_p_are_transformers(temperature, top_k, top_p):
    logits = random_logits(rows=4, vocab=80, seed=2)
    theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    ours = warp(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(distribution(ours), distribution(theirs))


# --- in the engine: overlap, preemption, refills ------------------------------------------------
@torch.no_grad()
def reference_greedy(model, prompt, steps, params):
    """Greedy tokens with the penalties applied by hand to transformers' logits, no cache."""
    seq, out = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        seen = set(seq)
        for j in seen:
            r = params.repetition_penalty
            logits[j] = logits[j] / r if logits[j] > 0 else logits[j] * r
        for j in set(out):
            logits[j] -= out.count(j) * params.frequency_penalty + params.presence_penalty
        out.append(int(logits.argmax()))
        seq.append(out[-1])
    return out


def test_penalties_with_the_overlap_refills_and_preemption(tiny, make_engine):
    """Penalized greedy rows equal the by-hand reference, and every row (sampled ones too) is the
    same with the overlap on: a step queued ahead counts the token it feeds, which the host's
    output_token_ids lack then. Batch 3 for 8 prompts (slots reused) and a pool that runs out."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    kinds = [SamplingParams(repetition_penalty=1.6, max_tokens=16, ignore_eos=True),
             SamplingParams(presence_penalty=1.5, frequency_penalty=0.7, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, min_p=0.05, frequency_penalty=1.0, repetition_penalty=1.2, seed=4,
                            max_tokens=14, ignore_eos=True),
             SamplingParams(max_tokens=10, ignore_eos=True)]
    params = [kinds[i % 4] for i in range(8)]

    def run(overlap):
        engine = make_engine(tiny, batch=3, num_blocks=2 * 5).engine
        engine.overlap = overlap
        seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        return [s.output_token_ids for s in seqs], engine

    plain, _ = run(False)
    overlapped, engine = run(True)
    assert overlapped == plain
    assert engine.num_launched_ahead > 5 and engine.scheduler.num_preemptions > 0
    model = hf_model(tiny)
    for i in (0, 1, 4, 5):
        assert plain[i] == reference_greedy(model, prompts[i], params[i].max_tokens, params[i])
    unpenalized = [reference_greedy(model, prompts[i], 16, SamplingParams()) for i in (0, 1)]
    assert [plain[0], plain[1]] != [unpenalized[0][:16], unpenalized[1][:12]], "the penalties changed nothing"


def test_stop_strings_with_the_overlap(stories, make_engine):
    """Stop strings found at different steps end their sequences as stop tokens do: the same text
    with the overlap on, the step ahead's token dropped, every block back."""
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot", "Lily"]
    params = SamplingParams(max_tokens=40, stop=("park", " he", "."), ignore_eos=True, logprobs=2)

    def run(overlap):
        loaded = make_engine(stories, batch=2)
        engine = loaded.engine
        engine.overlap = overlap
        seqs = add_requests(engine, loaded.tokenizer, texts, params, chat=False)
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.in_flight is None and engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        return [(s.output_token_ids, s.stop_strings.text(True), s.finish_reason) for s in seqs], seqs, engine

    plain, plain_seqs, _ = run(False)
    overlapped, seqs, engine = run(True)
    assert overlapped == plain and engine.num_launched_ahead > 0
    assert all(reason == "stop" for _, _, reason in plain)
    assert len({len(tokens) for tokens, _, _ in plain}) > 1, "meant to stop at different steps"
    for a, b in zip(seqs, plain_seqs):  # one entry per token kept, the step ahead's dropped with it
        assert len(a.logprobs) == len(a.output_token_ids)
        ranks_and_ids = [[(e.rank, [i for i, _ in e.top]) for e in s.logprobs] for s in (a, b)]
        assert ranks_and_ids[0] == ranks_and_ids[1]
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)


def same_answers(ours, theirs):
    """Equal, but for the logprobs' last digits: a batch of two computes in another order than one."""
    def values(x):
        return [e.logprob for e in x] + [lp for e in x for _, lp in e.top]

    for a, b in zip(ours, theirs, strict=True):
        assert a[:1] + a[2:] == b[:1] + b[2:]
        assert [(e.rank, [i for i, _ in e.top]) for e in a[1]] == [(e.rank, [i for i, _ in e.top]) for e in b[1]]
        assert values(a[1]) == pytest.approx(values(b[1]), abs=1e-4)


def test_parallel_samples_and_a_cached_prefix_answer_as_solo_runs(stories, make_engine):
    """Penalties, min-p, a stop string and logprobs: the answers of --n 2 (sharing blocks) and of a
    prompt whose prefix comes from the cache are those of each run alone."""
    prefix = "Once upon a time, there was a little girl named Lily. She loved to play"
    texts = [prefix + " outside", prefix + " with her ball"]
    params = SamplingParams(temperature=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.2, stop=("!",), logprobs=3, max_tokens=25, seed=11)

    def answers(loaded, seqs):
        engine = loaded.engine
        while engine.has_unfinished:
            engine.step()
        return [(s.output_token_ids, s.logprobs, s.finish_reason, s.stop_strings.text(True)) for s in seqs]

    def solo(text, seed):
        loaded = make_engine(stories, block_size=8)
        return answers(loaded, add_requests(loaded.engine, loaded.tokenizer, [text], params.__class__(
            **{**params.__dict__, "seed": seed}), chat=False))[0]

    loaded = make_engine(stories, block_size=8, batch=2)
    forked = answers(loaded, add_requests(loaded.engine, loaded.tokenizer, texts[:1], params, chat=False, samples=2))
    same_answers(forked, [solo(texts[0], 11), solo(texts[0], 12)])
    assert forked[0] != forked[1]
    loaded = make_engine(stories, block_size=8, batch=1)  # one slot: the second prompt finds the first's blocks
    both = answers(loaded, add_requests(loaded.engine, loaded.tokenizer, texts, params, chat=False))
    assert loaded.engine.scheduler.cached_prompt_tokens >= 16
    same_answers(both, [solo(texts[0], 11), solo(texts[1], 12)])


# --- the command line ----------------------------------------------------------------------------
def generate_json(stories, *args) -> list[dict]:
    code, out, err = invoke("generate", "--model", str(stories), "--raw", "--json", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_greedy_repetition_penalty_is_transformers_generate(stories):
    ids = generate_json(stories, "--repetition-penalty", "1.3", "--max-tokens", "40", "--ignore-eos",
                        STORY_PROMPT)[0]
    model = hf_model(stories)
    prompt = torch.tensor([ids["prompt_token_ids"]])
    expected = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, repetition_penalty=1.3)
    plain = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert ids["token_ids"] == expected[0, prompt.shape[1]:].tolist()
    assert ids["token_ids"] != plain[0, prompt.shape[1]:].tolist()


def test_stop_strings_cut_the_text(stories, make_engine):
    tokenizer = make_engine(stories).tokenizer
    free = generate_json(stories, "--max-tokens", "40", STORY_PROMPT)[0]
    assert free["text"].startswith(", there was a little girl named Lily. She loved to play outside in the park.")
    # "l na" spans the tokens of "girl" and " named"; the earliest of two stop strings wins
    for stops, text in [(["park", "Lily"], ", there was a little girl named "), (["l na"], ", there was a little gir")]:
        record = generate_json(stories, "--max-tokens", "40", *[a for s in stops for a in ("--stop", s)],
                               STORY_PROMPT)[0]
        assert record["text"] == text and record["finish_reason"] == "stop"
        n = len(record["token_ids"])
        assert record["token_ids"] == free["token_ids"][:n]  # up to the token that completed the stop string
        before, upto = (tokenizer.decode(record["token_ids"][:k]) for k in (n - 1, n))
        assert not any(s in before for s in stops) and any(upto.startswith(text + s) for s in stops)
    code, out, _ = invoke("generate", "--model", str(stories), "--raw", "--max-tokens", "40", "--stop", "Lily",
                          STORY_PROMPT)
    assert code == 0 and out == STORY_PROMPT + ", there was a little girl named \n"


def test_logprobs_are_transformers_log_softmax(stories):
    """Sampled at temperature 1.5, so that chosen tokens are not always the likeliest; logprobs
    are of the model's raw logits, as vLLM's default."""
    record = generate_json(stories, "--logprobs", "3", "--temperature", "1.5", "--seed", "3", "--max-tokens", "16",
                           "--ignore-eos", STORY_PROMPT)[0]
    prompt, tokens = record["prompt_token_ids"], record["token_ids"]
    with torch.no_grad():
        logits = hf_model(stories)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    expected = logits.log_softmax(-1)
    entries = record["logprobs"]
    assert len(entries) == len(tokens) == 16
    ranks = []
    for row, token, entry in zip(expected, tokens, entries):
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry["rank"] == int((row > row[token]).sum()) + 1
        ranks.append(entry["rank"])
    assert max(ranks) > 1, "every token was the likeliest: the test checks nothing about rank"
    assert entries[0]["token"] == ","
    only = generate_json(stories, "--logprobs", "0", "--max-tokens", "4", STORY_PROMPT)[0]["logprobs"]
    assert len(only) == 4 and all(e["top_logprobs"] == [] and e["rank"] == 1 for e in only)


def test_parallel_samples_on_the_command_line_are_solo_runs(stories):
    options = ["--temperature", "0.9", "--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--min-p", "0.05",
               "--stop", "park", "--logprobs", "2", "--max-tokens", "30"]
    pair = generate_json(stories, *options, "--n", "2", "--seed", "5", STORY_PROMPT)
    alone = [generate_json(stories, *options, "--seed", str(seed), STORY_PROMPT)[0] for seed in (5, 6)]
    for ours, theirs in zip(pair, alone, strict=True):  # the logprobs but for their last digits (batch 2 vs 1)
        ours.pop("sample")
        lps = [ours.pop("logprobs"), theirs.pop("logprobs")]
        assert ours == theirs and theirs["finish_reason"] in ("stop", "length")
        flat = [[e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]] for x in lps for e in x]
        assert [[t["token_id"] for t in e["top_logprobs"]] for e in lps[0]] == \
            [[t["token_id"] for t in e["top_logprobs"]] for e in lps[1]]
        half = len(flat) // 2
        assert sum(flat[:half], []) == pytest.approx(sum(flat[half:], []), abs=1e-4)
    assert pair[0]["token_ids"] != pair[1]["token_ids"]


@pytest.mark.parametrize("args, fragment", [
    (["--repetition-penalty", "-1"], "--repetition-penalty -1.0: must be a positive number"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: must be a positive number"),
    (["--presence-penalty", "2.5"], "--presence-penalty 2.5: must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty -3.0: must be in [-2, 2]"),
    (["--min-p", "1.5"], "--min-p 1.5: must be in [0, 1]"),
    (["--min-p", "nan"], "--min-p nan: must be in [0, 1]"),
    (["--logprobs", "21"], "--logprobs 21: must be from 0 to 20"),
    (["--logprobs", "-1"], "--logprobs -1: must be from 0 to 20"),
    (["--stop", "ok", "--stop", ""], "--stop '': a stop string must not be empty"),
])
def test_bad_values_are_one_line(stories, args, fragment):
    code, out, err = invoke("generate", "--model", str(stories), *args, "hi")
    assert_one_line(code, err, 2, fragment)
    assert out == ""


# --- on a GPU: the decode graphs and the overlap ---------------------------------------------------
def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")
def test_the_options_on_cuda_with_graphs_and_the_overlap(stories, make_engine):
    """The same answers with the overlap on and off (penalties counting the token fed on the device,
    stop strings dropping the step ahead, logprobs copied with the tokens), and greedy penalized
    answers as on the CPU."""
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot", "Lily"]
    kinds = [SamplingParams(repetition_penalty=1.4, max_tokens=40, logprobs=2, ignore_eos=True),
             SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, stop=(" park", "!"), max_tokens=40),
             SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2, seed=3, max_tokens=40, logprobs=0),
             SamplingParams(max_tokens=30, stop=(".",), ignore_eos=True)]

    def run(device, overlap):
        loaded = make_engine(stories, device=device, dtype="float32", batch=2)
        engine = loaded.engine
        engine.overlap = overlap
        seqs = [add_requests(engine, loaded.tokenizer, [t], p, chat=False)[0] for t, p in zip(texts, kinds)]
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        return [(s.output_token_ids, s.finish_reason, s.stop_strings and s.stop_strings.text(True),
                 [(e.rank, [i for i, _ in e.top]) for e in s.logprobs]) for s in seqs], seqs, engine

    plain, plain_seqs, _ = run("cuda", False)
    overlapped, seqs, engine = run("cuda", True)
    assert overlapped == plain and engine.num_launched_ahead > 10
    for a, b in zip(seqs, plain_seqs):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    cpu, _, _ = run("cpu", False)
    assert [cpu[i][0] for i in (0, 1, 3)] == [plain[i][0] for i in (0, 1, 3)]
