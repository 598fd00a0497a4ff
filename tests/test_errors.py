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
from pathlib import Path

import pytest

from helpers import assert_one_line, invoke


def generate(*args):
    return invoke("generate", *args)


@pytest.fixture
def model_copy(stories, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(stories, folder)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


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
    (["--model", "random:llama-3.2-1b"], "random weights are for bench"),  # 2.5 GB of weights it need not fill
    (["--chat"], "has no chat template"),
])
def test_a_model_that_cannot_serve_the_command_is_refused_before_its_weights(stories, args, fragment,
                                                                              monkeypatch):
    def no_weights(*_):
        raise AssertionError("weights were loaded for a model the command refuses")

    monkeypatch.setattr("pagedcli.model.loader.random_weights", no_weights)
    monkeypatch.setattr("pagedcli.model.loader.load_weights", no_weights)
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


@pytest.mark.parametrize("args, code, fragment", [
    (["--temperature", "nan"], 2, "--temperature nan"),
    (["--seed", str(2**70)], 2, f"--seed {2**70}: must fit in 64 bits"),
    (["--max-model-len", "0"], 2, "--max-model-len 0: must be at least 1"),
    (["--model", ""], 2, "--model is empty"),
    (["--num-blocks", "100000000000"], 2, "more than the 2,147,483,647 a block table can number"),  # int32 ids
    (["--num-blocks", "100000000"], 1, "does not fit in cpu memory"),  # 1.5 TiB: refused at once
])
def test_values_no_run_can_use(stories, args, code, fragment):
    model = [] if "--model" in args else ["--model", str(stories)]
    c, _, err = generate(*model, "--device", "cpu", *args, "hi")
    assert_one_line(c, err, code, fragment)


@pytest.mark.parametrize("config, fragment", [
    ({"do_sample": True, "top_p": 0}, "generation_config.json: top_p 0: must be in (0, 1]"),
    ({"do_sample": True, "temperature": "hot"}, "generation_config.json: temperature 'hot' is not a number"),
    ({"do_sample": True, "top_k": 5.5}, "generation_config.json: top_k 5.5 is not a whole number"),
    ([1, 2], "generation_config.json holds a JSON list, not an object"),
])
def test_a_broken_generation_config_is_named(model_copy, config, fragment):
    (model_copy / "generation_config.json").write_text(json.dumps(config))
    code, _, err = generate("--model", str(model_copy), "hi")
    assert_one_line(code, err, 1, fragment)
    if isinstance(config, dict):  # the option it names overrides the file
        option = "--" + next(k for k in config if k != "do_sample").replace("_", "-")
        value = {"--top-p": "0.9", "--temperature": "0.5", "--top-k": "5"}[option]
        code, _, err = generate("--model", str(model_copy), option, value, "--max-tokens", "3", "hi")
        assert code == 0, err


def test_a_tokenizer_that_is_not_the_models_fails_each_prompt_it_breaks(model_copy):
    """stories260K's weights (512 tokens) with the demo model's tokenizer (more): a prompt that
    encodes past the model's vocabulary is refused; one that does not still runs."""
    demo = Path(__file__).parent.parent / "pagedcli" / "data" / "demo"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, model_copy / name)
    code, out, err = generate("--model", str(model_copy), "--raw", "--json", "--max-tokens", "3", "--ignore-eos",
                              "ROMEO: hello", "a")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and "outside the model's vocabulary of 512" in err and "Traceback" not in err
    assert [r["finish_reason"] for r in records] == ["error", "length"]


def test_output_that_cannot_be_written_is_one_line(stories):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "--model", str(stories), "--max-tokens",
                              "20", "Once upon a time"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["error: writing the output failed: No space left on device (free "
                                               "some space, or write it elsewhere)"]


def test_prompt_longer_than_the_pool_fails_alone(stories):
    code, out, err = generate("--model", str(stories), "--num-blocks", "10", "--max-tokens", "3", "--json",
                              "Once upon a time", "a " * 60)
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and "--cache-size" in err
    assert records[0]["finish_reason"] == "length" and records[1]["finish_reason"] == "error"


def test_answers_cut_short_by_the_pool_say_so(stories):
    code, _, err = generate("--model", str(stories), "--num-blocks", "10", "--max-tokens", "50", "--ignore-eos",
                            "Once upon a time")
    assert code == 0 and "1 answer stopped at" in err and "use a larger --cache-size" in err
    code, _, err = generate("--model", str(stories), "--max-tokens", "5", "Once upon a time")
    assert code == 0 and "stopped at" not in err  # --max-tokens is not a cut


def test_ctrl_c_keeps_what_was_printed(stories):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedcli", "generate", "--model", str(stories), "--raw",
                             "--ignore-eos", "--max-tokens", "500", "--batch", "1", "Once upon a time", "The dog"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env,
                            # as a terminal starts it: a suite run in a shell's background job inherits
                            # SIGINT ignored, and Python then leaves it ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = os.read(proc.stdout.fileno(), 30)  # wait until the answer is streaming
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    out, err = (first + rest).decode(), err.decode()
    assert proc.returncode == 130, err
    assert "[2]" not in out, "a prompt that never ran was printed"
    assert out.startswith("[1] Once upon a time, there was")
    assert "Traceback" not in err and "interrupted" in err


def test_a_hub_id_offline_says_how_to_get_it(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "--model", "meta-llama/Llama-3.2-1B-Instruct",
                          "hi"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert "HF_HUB_OFFLINE is set" in out.stderr and "hf auth login" in out.stderr and "local folder" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, size, hint", [
    ([], "4.6 GiB in float32", "use --dtype bfloat16 (half the bytes), or a smaller model"),
    (["--dtype", "bfloat16"], "2.3 GiB in bfloat16", "use --quantization fp8 (about half the bytes) or int4"),
    (["--dtype", "bfloat16", "--quantization", "fp8"], "1.6 GiB in bfloat16 with fp8 weights", "use a smaller model"),
    # float32 activations keep a float32 copy beside the 4-bit values (backends/cpu_quant.py)
    (["--quantization", "int4"], "6.2 GiB in float32 with int4 weights", "use --dtype bfloat16"),
])
def test_weights_past_the_hosts_free_memory_are_one_line_before_they_load(monkeypatch, args, size, hint):
    """On Linux the out-of-memory killer would end the run without a word: the loader refuses first."""
    from pagedcli.model import host_memory as memory

    monkeypatch.setattr(memory, "available_host_memory", lambda: 2**30)
    code, _, err = invoke("bench", "--model", "random:llama-3.2-1b", "--batch", "1", "--input-len", "4",
                          "--output-len", "2", *args)
    assert_one_line(code, err, 1, f"the weights ({size}) do not fit in the 1.0 GiB of memory this machine has free",
                    hint)


def test_a_checkpoint_past_the_hosts_free_memory_is_one_line(monkeypatch, stories):
    from pagedcli.model import host_memory as memory

    monkeypatch.setattr(memory, "available_host_memory", lambda: 2**10)
    code, _, err = generate("--model", str(stories), "--max-tokens", "3", "Once")
    assert_one_line(code, err, 1, "the weights (0.0 GiB in float32) do not fit in the 0.0 GiB")


def test_weights_that_fit_the_hosts_free_memory_load(monkeypatch, stories):
    from pagedcli.model import host_memory as memory

    monkeypatch.setattr(memory, "available_host_memory", lambda: 2**30)  # stories260K: about 1 MB
    code, out, err = generate("--model", str(stories), "--max-tokens", "3", "Once")
    assert code == 0 and out.startswith("Once"), err
