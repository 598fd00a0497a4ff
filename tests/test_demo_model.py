"""The built-in model: ships in the package, loads like any Hugging Face folder, matches
transformers, and is what a fresh machine gets."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedcli.model.source import DEMO_FOLDER, resolve_model
from pagedcli.core.options import SamplingParams
from test_oracle import assert_matches_hf


def test_demo_folder_is_a_small_llama_with_its_card():
    assert (DEMO_FOLDER / "model.safetensors").stat().st_size <= 8_000_000
    config = resolve_model("demo").config
    assert config.num_kv_heads < config.num_heads and config.head_dim == 64 and config.tie_word_embeddings
    card = (DEMO_FOLDER / "README.md").read_text()
    val_loss = json.loads((DEMO_FOLDER / "training.json").read_text())["val_loss"]
    assert f"{val_loss:.3f}" in card


def test_demo_greedy_text_is_deterministic(make_engine):
    loaded = make_engine("demo")
    prompt = loaded.tokenizer.encode("ROMEO:")
    runs = [loaded.engine.run_to_completion([prompt], SamplingParams(max_tokens=40))[0].output_token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    text = loaded.tokenizer.decode(runs[0])
    assert text.startswith("\nI would not be a word")


def test_demo_matches_transformers(make_engine):
    loaded = make_engine("demo", batch=2)
    tok = loaded.tokenizer
    assert_matches_hf(loaded, DEMO_FOLDER, [tok.encode(t) for t in ["ROMEO:", "JULIET:\nO", "First Citizen:"]],
                      steps=24)


def test_a_fresh_machine_gets_the_demo_model_offline(tmp_path):
    """An empty Hugging Face cache and no network: `generate` with no --model uses the demo model
    and says so, and how to get the real one."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "ROMEO:", "--max-tokens", "20"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ROMEO:\n")
    assert "built-in demo model" in out.stderr and "Llama-3.2-1B-Instruct" in out.stderr


def test_the_models_sampling_settings_apply_unless_given():
    """generation_config.json asks for sampling (as Llama-3.2-1B-Instruct's does): without options
    generate samples; --temperature 0 is greedy; a seed repeats a draw."""
    from typer.testing import CliRunner

    from pagedcli.commands.app import app

    def run(*args):
        r = CliRunner().invoke(app, ["generate", "--model", "demo", "--json", "--max-tokens", "30", *args, "ROMEO:"])
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)["token_ids"]

    greedy = run("--temperature", "0")
    assert run("--temperature", "0") == greedy
    assert run("--seed", "3") == run("--seed", "3") != greedy
