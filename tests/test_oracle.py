"""Greedy generation through the paged cache equals transformers' LlamaForCausalLM, token for
token, with per-step logits within fp32 rounding, across the shapes Llama checkpoints come in."""

from __future__ import annotations

import random

import pytest

from helpers import hf_greedy, hf_model, run_greedy
from conftest import hf_checkpoint
from pagedcli.core.options import SamplingParams

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

CONFIGS = {
    "gqa-hd16-tied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mqa-hd32-untied-llama3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                   tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "mha-hd128-untied": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=128, hidden_size=96,
                             tie_word_embeddings=False),
    "gqa4-hd64-llama3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=128,
                             num_hidden_layers=3, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
}
PROMPT_LENS = [1, 7, 16, 17, 32, 45]  # on, off, and across block boundaries
STEPS = 20
ATOL = 2e-4  # fp32: two implementations of the same sums differ by rounding only


def prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(loaded, folder, prompt_list, steps=STEPS):
    results = run_greedy(loaded, prompt_list, steps)
    ref = hf_model(folder)
    for (ours, logits), prompt in zip(results, prompt_list):
        tokens, ref_logits = hf_greedy(ref, prompt, steps)
        diff = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
        assert diff < ATOL, f"logits differ by {diff}"
        assert ours == tokens, f"prompt of {len(prompt)} tokens diverges"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_transformers(tmp_path, make_engine, name):
    folder = hf_checkpoint(tmp_path, **CONFIGS[name])
    loaded = make_engine(folder, batch=3)
    assert_matches_hf(loaded, folder, prompts(PROMPT_LENS, 211))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(tmp_path, make_engine, block_size):
    folder = hf_checkpoint(tmp_path, **CONFIGS["gqa-hd16-tied"])
    loaded = make_engine(folder, batch=4, block_size=block_size)
    assert_matches_hf(loaded, folder, prompts([5, block_size, block_size + 1, 2 * block_size + 3], 211, seed=1))


def test_freed_blocks_are_reused_by_later_prompts(tmp_path, make_engine):
    """A pool with room for barely two sequences: later prompts must run in blocks that earlier
    ones gave back, and still match the oracle."""
    folder = hf_checkpoint(tmp_path, **CONFIGS["gqa-hd16-tied"])
    layers = 2
    loaded = make_engine(folder, batch=2, num_blocks=2 * layers * 4)  # 4 blocks of 16 per sequence
    engine = loaded.engine
    owners: dict[int, set[int]] = {}
    step = engine.step

    def watching_step():
        out = step()
        for seq in engine.scheduler.running:
            for b in engine.cache.table[seq.slot].ravel().tolist():
                if b >= 0:
                    owners.setdefault(b, set()).add(seq.id)
        return out

    engine.step = watching_step
    assert_matches_hf(loaded, folder, prompts([9, 30, 12, 40, 3], 211, seed=2), steps=18)
    assert any(len(ids) > 1 for ids in owners.values()), "no block was ever reused"


def test_real_model_tells_its_story(stories, make_engine):
    """stories260K from BOS: the greedy text SOURCE.md gives, which llama2.c documents."""
    expected = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
                "One day, she saw a big, red ball. She wanted to play with it, but it was too high")
    loaded = make_engine(stories)
    seq = loaded.engine.run_to_completion([[1]], SamplingParams(max_tokens=60))[0]
    assert loaded.tokenizer.decode(seq.output_token_ids) == expected


def test_real_model_matches_transformers(stories, make_engine):
    loaded = make_engine(stories, batch=2)
    tok = loaded.tokenizer
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot and the little bird"]
    assert_matches_hf(loaded, stories, [tok.encode(t) for t in texts], steps=30)
