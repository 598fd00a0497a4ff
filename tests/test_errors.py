"""Bad input ends in one clear line naming the value and a way out, with the right exit code and
no traceback (2: a usage mistake, 1: a failure while running, 130: Ctrl-C)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import invoke


def generate(*args):
    return invoke("generate", *args)


@pytest.fixture
def model_copy(stories, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(stories, folder)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


def assert_one_line(code, stderr, expected_code, *fragments):
    assert code == expected_code, stderr
    assert "Traceback" not in stderr
    assert len([line for line in stderr.strip().splitlines() if line.startswith("error:")]) == 1, stderr
    for f in fragments:
        assert f in stderr, stderr


def test_config_json_missing(model_copy):
    (model_copy / "config.json").unlink()
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 2, "config.json not found")


def test_config_json_invalid(model_copy):
    (model_copy / "config.json").write_text("{ not json")
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, "config.json is not valid JSON")


def test_unsupported_architecture_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, "GPT2LMHeadModel", "not supported")


def test_tensor_missing_is_named(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, "model.layers.3.mlp.down_proj.weight", "missing")


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, "model.safetensors")


def test_garbage_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, "safetensors")


def test_missing_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 2, "tokenizer")


@pytest.mark.parametrize("args, fragment", [
    (["--model", "random:llama-3.2-1b"], "has no tokenizer"),  # 2.5 GB of weights it need not fill
    (["--chat"], "has no chat template"),
])
def test_a_model_that_cannot_serve_the_command_is_refused_before_its_weights(stories, args, fragment,
                                                                              monkeypatch):
    def no_weights(*_):
        raise AssertionError("weights were loaded for a model the command refuses")

    monkeypatch.setattr("pagedcli.loader.random_weights", no_weights)
    monkeypatch.setattr("pagedcli.loader.load_weights", no_weights)
    code, _, err = generate("--model", str(stories), *args, "hi")
    assert_one_line(code, err, 2, fragment)


@pytest.mark.parametrize("args, code, fragment", [
    (["--block-size", "12"], 2, "--block-size 12"),
    (["--num-blocks", "3"], 2, "one block per layer"),
    (["--cache-size", "lots"], 2, "--cache-size 'lots'"),
    (["--batch", "0"], 2, "--batch 0"),
    (["--dtype", "int8"], 2, "--dtype 'int8'"),
    (["--device", "tpu"], 2, "--device 'tpu'"),
])
def test_bad_cache_and_device_options(stories, args, code, fragment):
    c, _, err = generate("--model", str(stories), *args, "hi")
    assert_one_line(c, err, code, fragment)


def test_prompt_longer_than_the_pool_fails_alone(stories):
    code, out, err = generate("--model", str(stories), "--num-blocks", "10", "--max-tokens", "3", "--json",
                              "Once upon a time", "a " * 60)
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and "--cache-size" in err
    assert records[0]["finish_reason"] == "length" and records[1]["finish_reason"] == "error"


def test_ctrl_c_keeps_what_was_printed(stories):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedcli", "generate", "--model", str(stories), "--raw",
                             "--ignore-eos", "--max-tokens", "500", "--batch", "1", "Once upon a time", "The dog"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env)
    first = os.read(proc.stdout.fileno(), 30)  # wait until the answer is streaming
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    out, err = (first + rest).decode(), err.decode()
    assert proc.returncode == 130, err
    assert "[2]" not in out, "a prompt that never ran was printed"
    assert out.startswith("[1] 'Once upon a time'\nOnce upon a time, there was")
    assert "Traceback" not in err and "interrupted" in err


def test_a_hub_id_offline_says_how_to_get_it(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "--model", "meta-llama/Llama-3.2-1B-Instruct",
                          "hi"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert "HF_HUB_OFFLINE is set" in out.stderr and "hf auth login" in out.stderr and "local folder" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
