"""Values from the command line, prompt files, the bandwidth cache, the output pipe and signals:
each a correct run or one clear line, never a traceback."""

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
import torch

from helpers import invoke
from pagedcli.bench import bandwidth as bench
from pagedcli.commands import bench_plot
from pagedcli.core.errors import UsageError
from pagedcli.console.prompts import read_prompts
from pagedcli.engine.sampler import _draw
from pagedcli.engine.sequence import Sequence
from pagedcli.core.options import SamplingParams

DEMO = Path(__file__).parent.parent / "pagedcli" / "data" / "demo"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# --- prompt files and arguments ----------------------------------------------------------------------
def test_prompt_files_split_on_newlines_only_and_lose_a_byte_order_mark(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes("\ufeffone\u2028still one\x85\x0c\x1c end\r\ntwo\r\n\r\n  \nthree".encode())
    assert read_prompts([], f) == ["one\u2028still one\x85\x0c\x1c end", "two", "three"]


@pytest.mark.parametrize("prompt, fragment", [
    ("caf\udce9", "prompt 2 is not valid UTF-8 text (byte 0xe9 at character 4)"),  # b"caf\xe9" via surrogateescape
    ("a\ud800b", "prompt 2 is not valid UTF-8 text (a lone surrogate U+D800 at character 2)"),
])
def test_a_prompt_argument_that_is_not_utf8_is_one_line(stories, prompt, fragment):
    code, out, err = invoke("generate", "--model", str(stories), "--max-tokens", "3", "fine", prompt)
    assert code == 2 and one_error_line(err).startswith("error: " + fragment) and out == ""


# --- sampling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_top_p_keeps_the_likeliest_token_however_small(top_p):
    logits = torch.tensor([0.5, 3.0, 1.0, 2.9])
    seq = Sequence(0, [1], SamplingParams(temperature=1.0, top_p=top_p, seed=0))
    assert [int(_draw(logits, seq)[0]) for _ in range(5)] == [1] * 5


# --- bench -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"[1, 2]", b'{"cpu:1t": "fast"}', b'{"cpu:1t": -3}', b"\xff\xfe{", b"{",
                                     b'{"cpu:1t": NaN}', b'{"cpu:1t": true}'])
def test_a_corrupt_bandwidth_cache_is_measured_again(tmp_path, monkeypatch, content):
    cache = tmp_path / "bandwidth.json"
    cache.write_bytes(content)
    monkeypatch.setattr(bench, "BANDWIDTH_CACHE", cache)
    monkeypatch.setitem(bench.COPY_BYTES, "cpu", 1 << 20)  # what is checked is the rewrite, not the figure
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    gbps = bench.measure_bandwidth(torch.device("cpu"))
    assert gbps > 0 and json.loads(cache.read_text())["cpu:1t"] == gbps  # rewritten with the measurement


def test_plot_in_a_format_matplotlib_lacks(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(UsageError, match=r"matplotlib cannot write \.xyz files \(use one of .*\.png"):
        bench_plot.plot_path(tmp_path / "bench.xyz")
    assert bench_plot.plot_path(tmp_path / "bench.svg") == tmp_path / "bench.svg"


def test_plot_to_a_folder_that_cannot_be_written(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(UsageError, match="cannot be written"):
            bench_plot.plot_path(locked / "bench.png")
    finally:
        locked.chmod(0o700)


def test_bench_refuses_a_prefix_len_with_a_prompt_file(stories, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Once upon a time\n")
    code, _, err = invoke("bench", "--model", str(stories), "--prompt-file", str(f), "--prefix-len", "4")
    assert code == 2 and "--prefix-len" in one_error_line(err) and "--prompt-file" in err


def test_a_bench_whose_every_request_is_refused_fails(stories, tmp_path):
    """stories260K's weights with the demo model's larger tokenizer: every prompt of the file
    encodes past the model's vocabulary."""
    model = tmp_path / "model"
    shutil.copytree(stories, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, model / name)
    f = tmp_path / "p.txt"
    f.write_text("ROMEO: hello\n")
    code, out, err = invoke("bench", "--model", str(model), "--prompt-file", str(f), "--batch", "1",
                            "--output-len", "2", "--bandwidth", "10")
    assert code == 1 and one_error_line(err).startswith("error: every request failed, the first: token id")
    assert "outside the model's vocabulary" in err and out == ""


# --- the output pipe and signals -----------------------------------------------------------------
def pagedcli(*args, **kwargs):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "pagedcli", *args], stderr=subprocess.PIPE, env=env, **kwargs)


def test_a_closed_stdout_ends_quietly(stories):
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write finds the pipe broken
    proc = pagedcli("generate", "--model", str(stories), "--max-tokens", "20", "Once upon a time", stdout=write)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE and err.decode() == ""


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")])
def test_sigterm_and_sighup_end_a_run_as_ctrl_c_does(stories, signum, code, word):
    proc = pagedcli("generate", "--model", str(stories), "--raw", "--ignore-eos", "--max-tokens", "500", "--batch", "1",
                    "Once upon a time", "The dog", stdout=subprocess.PIPE, bufsize=0)
    first = os.read(proc.stdout.fileno(), 30)  # the answer is streaming
    time.sleep(0.2)
    proc.send_signal(signum)
    rest, err = proc.communicate(timeout=60)
    out, err = (first + rest).decode(), err.decode()
    assert proc.returncode == code, err
    assert out.startswith("[1] Once upon a time, there was") and out.endswith("\n")
    assert "[2]" not in out, "a prompt that never ran was printed"
    assert "Traceback" not in err and err.strip() == word
