"""No request's numbers reach another's: a sequence whose K/V hold inf or NaN (a float16 overflow, a
broken weight) leaves every other sequence's logits exactly as they are when it runs alone."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import blocks_of, record_logits
from pagedcli.core.options import SamplingParams

PROMPTS = [[5, 9, 14, 3, 77, 21, 8, 40, 2, 19, 33, 60, 7, 18, 4, 90, 101, 12, 6],  # crosses a block boundary
           [11, 4, 150, 7], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 200]]
POISONED = 1  # the index in PROMPTS of the sequence whose blocks are poisoned
STEPS = 24
# a small pool, so blocks given back are handed out again; no cached prefixes, whose free blocks
# would be read again; no step queued ahead, which could write K/V before the poison lands
OPTS = dict(num_blocks=2 * 8, prefix_caching=False, overlap=False)
# batched against alone: the same math summed in another order (float32 on CPU: ~3e-6 seen)
ATOL = {torch.float32: 1e-4, "float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}


def fill(x: torch.Tensor) -> None:
    """+inf, -inf and NaN in turn."""
    flat = x.view(-1) if x.is_contiguous() else None
    if flat is None:
        values = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=x.dtype, device=x.device)
        x.copy_(values.repeat(x.numel() // 3 + 1)[: x.numel()].view_as(x))
        return
    flat[0::3], flat[1::3], flat[2::3] = float("inf"), float("-inf"), float("nan")


def poison(engine, bad) -> None:
    """inf and NaN in every K/V position that no sequence but `bad` may read: all of `bad`'s blocks,
    every free block, and in each other running sequence's blocks the positions it has not written
    yet (what a block's former owner may have left there)."""
    cache, bs = engine.cache, engine.cache.geometry.block_size
    whole = list(cache.allocator.free)
    for seq in engine.scheduler.running:
        for layer in range(cache.geometry.num_layers):
            blocks = blocks_of(cache, seq.slot, layer)
            if seq is bad:
                whole += blocks
                continue
            first = seq.num_cached // bs  # the block its next token goes into
            whole += blocks[first + 1:]
            if first < len(blocks):
                fill(cache.store.pool[blocks[first], :, seq.num_cached % bs:])
    for b in whole:
        fill(cache.store.pool[b])


def run(engine, prompts, poisoned: int | None = None, max_tokens: list[int] | None = None):
    """Each sequence and its logits at every step, by prompt index; `poisoned`: whose blocks are
    poisoned after every step."""
    seen = record_logits(engine)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, max_tokens or [STEPS] * len(prompts))]
    while engine.has_unfinished:
        engine.step()
        if poisoned is not None:
            poison(engine, seqs[poisoned])
    return seqs, [seen.get(s.id, []) for s in seqs]


def check_isolation(make, model, **opts) -> None:
    """The poisoned sequence fails alone; every other's logits are bit-identical to the same batch
    run clean (the poisoned one ending at the same step, so each step has the same shapes), and
    match its run alone (to rounding: a batch of other shapes sums in another order)."""
    seqs, batched = run(make(model, batch=len(PROMPTS), **opts).engine, PROMPTS, POISONED)
    bad = seqs[POISONED]
    assert bad.finish_reason == "error" and "not finite" in bad.error, bad.error
    lengths = [STEPS] * len(PROMPTS)
    lengths[POISONED] = len(bad.output_token_ids) + 1  # the step it failed at ends it by length instead
    _, clean = run(make(model, batch=len(PROMPTS), **opts).engine, PROMPTS, None, lengths)
    for i, prompt in enumerate(PROMPTS):
        if i == POISONED:
            continue
        alone_seqs, (alone,) = run(make(model, batch=1, **opts).engine, [prompt])
        assert seqs[i].output_token_ids == alone_seqs[0].output_token_ids and seqs[i].finish_reason == "length"
        assert len(batched[i]) == len(clean[i]) == len(alone) == STEPS
        for step, (a, b, c) in enumerate(zip(batched[i], clean[i], alone)):
            assert torch.equal(a, b), f"prompt {i}, step {step}: its logits changed beside a poisoned sequence"
            torch.testing.assert_close(a, c, rtol=0, atol=ATOL[a.dtype if opts.get("dtype") is None else opts["dtype"]])


def test_a_poisoned_sequence_changes_no_other_logits_on_torch(tiny, make_engine):
    check_isolation(make_engine, tiny, **OPTS)


def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_poisoned_sequence_changes_no_other_logits_on_cuda(tiny, make_engine, dtype, eager):
    check_isolation(make_engine, tiny, **OPTS, device="cuda", dtype=dtype, eager=eager)


def test_an_overflowing_request_leaves_its_neighbour_alone(stories, make_engine):
    """The issue's case: stories260K in float16, untied, one embedding value of token 403 (in the
    first prompt) set past float16's range. 'Lily' beside it must get what it gets alone."""
    def engine(batch):
        loaded = make_engine(stories, batch=batch, dtype="float16")
        w = loaded.weights
        w.lm_head = w.lm_head.clone()  # untied: the poisoned row must not be a logit
        loaded.engine.runner.model.w.lm_head = w.lm_head
        w.embed[403, 0] = 1e5  # inf in float16
        return loaded

    tok = make_engine(stories, batch=1).tokenizer
    once, lily = tok.encode("Once upon a time there was"), tok.encode("Lily")
    assert 403 in once and 403 not in lily
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = engine(1).engine.run_to_completion([lily], params)[0]
    both = engine(2).engine.run_to_completion([once, lily], params)
    assert both[1].output_token_ids == alone.output_token_ids and alone.finish_reason == "length"
    assert both[0].finish_reason == "error"


@pytest.fixture
def overflowing(stories, monkeypatch):
    """stories260K whose embedding of token 403 (in 'Once upon a time there was', not in 'Lily')
    holds an inf, as a float16 overflow leaves it; untied, so no logit is inf for that alone."""
    from pagedcli.engine import build as loader

    load_model = loader.load_model

    def poisoned(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.weights.lm_head = model.weights.lm_head.clone()
        model.weights.embed[403, 0] = float("inf")
        return model

    monkeypatch.setattr(loader, "load_model", poisoned)
    return stories


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]],
                         ids=["greedy", "sampling"])
def test_a_request_whose_logits_are_not_finite_fails_alone(overflowing, sampling):
    from helpers import invoke

    args = ["generate", "--model", str(overflowing), "--raw", "--max-tokens", "12", "--ignore-eos", *sampling]
    code, out, err = invoke(*args, "--json", "Once upon a time there was", "Lily")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1, err
    assert [r["finish_reason"] for r in records] == ["error", "length"] and len(records[1]["token_ids"]) == 12
    assert "not finite" in records[0]["error"]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: prompt 1: its logits are not finite"), err
    code, out, err = invoke(*args, "Once upon a time there was", "Lily")
    assert code == 1 and "[1] Once upon a time there was [error]\n" in out
    assert "Traceback" not in err and "\n[2] Lily " in out


@pytest.mark.parametrize("penalized", [False, True])
def test_a_distribution_that_overflows_after_the_temperature_fails_alone(tiny, make_engine, monkeypatch, penalized):
    """Finite logits that the sampler's own arithmetic turns non-finite (the temperature, a
    penalty): that request ends with an error, its batch mates get what they get alone (before,
    multinomial refused the NaN and failed the whole step)."""
    from pagedcli.engine import sampler

    warp = sampler.warp

    def overflow_for_seed_7(logits, params):  # as a temperature near 0 would make of a large logit
        out = warp(logits, params)
        return out * float("inf") if params.seed == 7 else out

    monkeypatch.setattr(sampler, "warp", overflow_for_seed_7)
    penalty = dict(repetition_penalty=1.2) if penalized else {}
    good = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3, **penalty),
            SamplingParams(max_tokens=10, ignore_eos=True, **penalty)]
    bad = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=7, **penalty)
    prompts = [[5, 9, 14], [11, 4, 150], [3, 3, 200]]
    alone = [make_engine(tiny, batch=1).engine.run_to_completion([p], q)[0].output_token_ids
             for p, q in zip(prompts[1:], good)]
    engine = make_engine(tiny, batch=3).engine
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, [bad, *good])]
    while engine.has_unfinished:
        engine.step()
    assert seqs[0].finish_reason == "error" and "not finite" in seqs[0].error
    assert [s.output_token_ids for s in seqs[1:]] == alone and all(s.finish_reason == "length" for s in seqs[1:])
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
