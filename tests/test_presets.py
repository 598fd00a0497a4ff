"""The shipped Llama presets, every RoPE type and the biases, against transformers' LlamaForCausalLM
(the other families' presets: test_families.py).

Each preset's geometry (heads, kv heads, head_dim, RoPE, tie) is cut to 2 layers and a small
hidden size (not heads x head_dim), intermediate size and vocabulary, so that it runs in a second; greedy tokens must
equal transformers' and the logits agree within fp32 rounding, with blocks handed out shuffled."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_checkpoint
from helpers import hf_greedy, hf_model, invoke, run_greedy
from test_oracle import ATOL, prompts
from pagedcli.core.batch import StepBatch
from pagedcli.model.config import ModelConfig
from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.source import RANDOM_PRESETS, resolve_model
from pagedcli.core.options import SamplingParams
from pagedcli.model.weights import random_weights

# Parameter counts of the public checkpoints (their safetensors' totals).
PUBLIC_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "codellama-7b": 6_738_546_688,
    "tinyllama-1.1b": 1_100_048_384, "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120,
    "smollm2-1.7b": 1_711_376_384, "deepseek-coder-1.3b": 1_346_471_936, "open-llama-3b": 3_426_473_600,
}
LLAMA_PRESETS = sorted(n for n, path in RANDOM_PRESETS.items() if json.loads(path.read_text())["model_type"] == "llama")
SMALL = dict(hidden_size=64, intermediate_size=96, vocab_size=256, num_hidden_layers=2)
STEPS = 12


def run_engine(loaded, prompt_list, steps=STEPS):
    """Greedy answers and each step's logits, all prompts in one engine."""
    return run_greedy(loaded, prompt_list, steps)


def assert_same(ours, ref):
    """Tokens identical; logits within fp32 rounding (relative to their size: wide heads on a
    small hidden size give logits of tens)."""
    (tokens, logits), (ref_tokens, ref_logits) = ours, ref
    scale = max(1.0, max(l.abs().max().item() for l in ref_logits))
    diff = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
    assert diff < ATOL * scale, f"logits differ by {diff} (scale {scale:.1f})"
    assert tokens == ref_tokens


def logits_gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# --- the presets -------------------------------------------------------------------------------
def test_the_presets_named_in_the_issue_are_shipped():
    assert set(PUBLIC_PARAMETERS) == set(LLAMA_PRESETS)


@pytest.mark.parametrize("name", sorted(RANDOM_PRESETS))
def test_preset_loads_as_random_weights_of_the_public_size(name):
    source = resolve_model(f"random:{name}")
    assert source.random and source.folder is None
    assert json.loads(RANDOM_PRESETS[name].read_text())["_comment"]  # says which checkpoint it reproduces
    if name not in PUBLIC_PARAMETERS:
        return  # another family's: its size is test_families.py's
    expected = PUBLIC_PARAMETERS[name]
    assert abs(source.config.num_parameters - expected) <= expected // 100


def test_bench_help_lists_every_preset_and_an_unknown_one_is_refused():
    code, out, _ = invoke("bench", "--help")
    assert code == 0 and all(name in out for name in RANDOM_PRESETS)
    with pytest.raises(UsageError, match="no such preset.*llama-2-7b.*tinyllama-1.1b"):
        resolve_model("random:llama-9")


def preset_checkpoint(folder, name, **overrides):
    """A transformers checkpoint of the preset's head geometry, RoPE and tie, cut small, with the
    RoPE settings written back as the preset writes them (rope_scaling beside rope_theta, `type`
    or `rope_type`: transformers 5 itself saves `rope_parameters`, which the other tests read)."""
    preset = json.loads(RANDOM_PRESETS[name].read_text())
    c = ModelConfig.from_dict(preset)
    hf_checkpoint(folder, **dict(
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        rope_theta=c.rope_theta, rope_scaling=preset.get("rope_scaling"), tie_word_embeddings=c.tie_word_embeddings,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias) | SMALL | overrides
        | {"hidden_size": -(-SMALL["hidden_size"] // c.num_heads) * c.num_heads})  # transformers wants a multiple
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg |= {"rope_theta": c.rope_theta, "rope_scaling": preset.get("rope_scaling")}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_preset_geometry_equals_transformers(tmp_path, make_engine, name):
    folder = preset_checkpoint(tmp_path, name)
    ours = ModelConfig.from_file(folder / "config.json")
    preset = resolve_model(f"random:{name}").config
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.rope_theta, ours.rope_scaling) == \
           (preset.num_heads, preset.num_kv_heads, preset.head_dim, preset.rope_theta, preset.rope_scaling)
    prompt_list = prompts([1, 17, 40], SMALL["vocab_size"], seed=3)
    results = run_engine(make_engine(folder, batch=3, num_blocks=64), prompt_list)
    ref = hf_model(folder)
    for prompt, result in zip(prompt_list, results):
        assert_same(result, hf_greedy(ref, prompt, STEPS))


# --- RoPE types ----------------------------------------------------------------------------------
# Short trained lengths, so that the prompts below (up to 40 tokens and 12 more) are past them.
ROPE_TYPES = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}, max_position_embeddings=128),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 max_position_embeddings=64),
    # a correction range of fractional bounds inside the head (1.6 to 5.2), which `truncate` rounds
    "yarn-options": dict(rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                       "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                                       "truncate": False}, max_position_embeddings=2048, rope_theta=10000.0),
    "yarn-attention-factor": dict(rope_scaling={"rope_type": "yarn", "factor": None, "attention_factor": 1.3,
                                                "original_max_position_embeddings": 16}, max_position_embeddings=64),
}


@pytest.mark.parametrize("kind", ROPE_TYPES)
def test_static_rope_types_equal_transformers(tmp_path, make_engine, kind):
    settings = dict(head_dim=32, rope_theta=500.0) | ROPE_TYPES[kind]
    folder = hf_checkpoint(tmp_path / "scaled", **settings)
    plain = hf_checkpoint(tmp_path / "plain", head_dim=32, rope_theta=settings["rope_theta"])  # same weights, no scaling
    prompt_list = prompts([5, 23, 40], 211, seed=4)
    results = run_engine(make_engine(folder, batch=3), prompt_list)
    ref, unscaled = hf_model(folder), hf_model(plain)
    for prompt, result in zip(prompt_list, results):
        expected = hf_greedy(ref, prompt, STEPS)
        assert_same(result, expected)
        assert logits_gap(expected[1], hf_greedy(unscaled, prompt, STEPS)[1]) > 1e-2, "the scaling does not matter here"


DYNAMIC = dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=16)


def hf_generate(folder, prompt, steps):
    """transformers' generate with its KV cache at batch 1, on a fresh model: its dynamic RoPE keeps
    the longest length it has seen between calls."""
    model = hf_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=steps, do_sample=False, use_cache=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [l[0].float() for l in out.logits]


def test_dynamic_ntk_equals_transformers_generate_and_ignores_batch_mates(tmp_path, make_engine):
    folder = hf_checkpoint(tmp_path / "dynamic", head_dim=32, eos_token_id=None, **DYNAMIC)
    plain = hf_checkpoint(tmp_path / "plain", head_dim=32, eos_token_id=None, max_position_embeddings=16)
    # below the trained 16 and crossing it while decoding, exactly at it, and past it from the prompt on
    prompt_list = prompts([3, 14, 16, 21, 40], 211, seed=5)
    loaded = make_engine(folder, batch=5)
    assert loaded.engine.cache.max_model_len == 64  # dynamic NTK serves factor x the trained length
    together = run_engine(loaded, prompt_list, steps=16)
    for prompt, result in zip(prompt_list, together):
        expected = hf_generate(folder, prompt, 16)
        assert_same(result, expected)
        assert logits_gap(expected[1], hf_generate(plain, prompt, 16)[1]) > 1e-2, "the scaling does not matter here"
    alone = run_engine(make_engine(folder, batch=1), prompt_list[1:2], steps=16)[0]
    assert alone[0] == together[1][0] and logits_gap(alone[1], together[1][1]) < 1e-5


def test_padding_rows_write_nothing_to_the_cache(tmp_path, make_engine):
    """The torch path's K/V write with CUDA graphs' padding rows (position -1, as the runner pads a
    batch to its graph's size): only the real rows' places change."""
    folder = hf_checkpoint(tmp_path, head_dim=32, **DYNAMIC)
    engine = make_engine(folder, batch=2, num_blocks=32).engine
    seq = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill: the sequence holds its blocks now
    be, cache = engine.runner.model.backend, engine.cache
    c = be.config

    def write(positions, slots):
        T = len(positions)
        batch = StepBatch(False, torch.zeros(T, dtype=torch.int64), torch.tensor(positions), torch.arange(T),
                          torch.tensor(slots, dtype=torch.int32), torch.tensor([p + 1 for p in positions], dtype=torch.int32),
                          torch.arange(T), [1] * T, [1] * T)
        be._step = be._rope_indices(batch)
        k, v = torch.randn(T, c.num_kv_heads, c.head_dim), torch.randn(T, c.num_kv_heads, c.head_dim)
        be.rope_write_kv(0, torch.randn(T, c.num_heads, c.head_dim), k, v, batch)
        return v

    before = cache.store.pool.clone()
    write([-1, -1, -1], [0, 0, 0])
    assert torch.equal(cache.store.pool, before)
    v = write([5, -1, -1], [seq.slot, 0, 0])
    physical = int(cache.store.device_table[seq.slot, 0, 0])
    changed = (cache.store.pool != before).nonzero()[:, [0, 2]].unique(dim=0).tolist()
    assert changed == [[physical, 5]] and torch.equal(cache.store.pool[physical, 1, 5], v[0])


# --- biases ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [dict(attention_bias=True), dict(mlp_bias=True),
                                  dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)])
def test_biases_equal_transformers(tmp_path, make_engine, bias):
    folder = hf_checkpoint(tmp_path, **bias)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        biases = [f.get_tensor(n) for n in f.keys() if n.endswith(".bias")]
    assert biases and all(b.abs().min() > 0 for b in biases)  # nonzero: a dropped bias shows
    prompt_list = prompts([4, 17, 33], 211, seed=6)
    results = run_engine(make_engine(folder, batch=3), prompt_list)
    ref = hf_model(folder)
    for prompt, result in zip(prompt_list, results):
        assert_same(result, hf_greedy(ref, prompt, STEPS))


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_and_bytes_include_the_biases(tie):
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=50, hidden_size=24, intermediate_size=40,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        attention_bias=True, mlp_bias=True, tie_word_embeddings=tie))
    weights = random_weights(config, torch.float32, "cpu")
    assert weights.nbytes == 4 * config.num_parameters
    plain = ModelConfig.from_dict(config.raw | dict(attention_bias=False, mlp_bias=False))
    assert config.num_parameters - plain.num_parameters == 2 * ((32 + 2 * 16 + 24) + (2 * 40 + 24))


# --- what is refused, in one line ------------------------------------------------------------------
BASE = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope scaling type 'longrope' is not supported"),
    ({"type": "su", "factor": 2.0}, "rope scaling type 'su' is not supported"),
    ({"rope_type": "linear"}, "'linear' needs a number 'factor'"),
    ({"type": "dynamic", "factor": None}, "rope_scaling.factor None must be a positive number"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "needs a number 'low_freq_factor'"),
    ({"rope_type": "yarn"}, "'yarn' needs a number 'factor'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_unsupported_or_incomplete_rope_is_one_line(rope, message):
    with pytest.raises(RunError, match=message) as e:
        ModelConfig.from_dict(BASE | {"rope_scaling": rope})
    assert "\n" not in str(e.value)


def test_rope_settings_read_both_spellings():
    old = ModelConfig.from_dict(BASE | {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0}})
    new = ModelConfig.from_dict(BASE | {"rope_parameters": {"rope_type": "linear", "type": "linear", "factor": 4.0,
                                                            "rope_theta": 1e6}})
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert old.rope_theta == new.rope_theta == 1e6
    default = ModelConfig.from_dict(BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    assert default.rope_scaling is None and default.rope_type == "default" and default.rope_theta == 5.0
