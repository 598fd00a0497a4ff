"""What one request or one value may cost, bounded (issue 51): stop strings (their number, their
length, and the work a step does for them), --n, the files a user names, and bench's counts and
timeouts. Each a correct run or one line with its exit code; no test here times anything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers import assert_one_line, invoke
from pagedcli.core.options import MAX_INPUT_FILE_BYTES, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams


# --- stop strings -----------------------------------------------------------------------------
@pytest.mark.parametrize("stop, fragment", [
    (tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop strings"),
    (("x" * (MAX_STOP_CHARS + 1),), f"at most {MAX_STOP_CHARS:,} characters"),
])
def test_too_many_or_too_long_stop_strings_are_refused(stop, fragment):
    """100,000 stop strings, each searched every step, made a neighbour's stream 4x slower."""
    name, _, why, _ = SamplingParams(stop=stop).problem()
    assert name == "stop" and fragment in why
    assert SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))).problem() is None
    assert SamplingParams(stop=("x" * MAX_STOP_CHARS,)).problem() is None
    args = [a for s in stop for a in ("--stop", s)]
    code, _, err = invoke("generate", "-m", "/nonexistent", *args, "hi")  # refused before the model is looked for
    assert_one_line(code, err, 2, "--stop", fragment)


class CountedText(str):
    """A detokenizer's text that counts the characters each search reads and each slice copies."""

    work = 0

    def find(self, sub, start=0, end=None):
        CountedText.work += len(self) - start
        return str.find(self, sub, start)

    def __getitem__(self, key):
        piece = str.__getitem__(self, key)
        CountedText.work += len(piece)
        return piece


class CountingDetokenizer:
    def __init__(self, _prompt_ids):
        self.text = CountedText("")
        self.num_seen = 0

    def catch_up(self, output_ids: list[int]) -> str:
        new = "ab" * (len(output_ids) - self.num_seen)
        self.num_seen = len(output_ids)
        self.text = CountedText(str.__add__(self.text, new))
        return new


def test_a_steps_stop_string_work_does_not_grow_with_the_answer(stories, make_engine):
    """The engine's search, the command line's printer and the server's delta each read only the
    step's new text and the stop strings' length before it: a step's work for a request stays
    bounded however long its answer grows. (The printer and the server copied the whole text each
    step: work growing with the square of the answer.)"""
    from pagedcli.commands.output import TextPrinter
    from pagedcli.serve.engine_process import EngineProcess
    from pagedcli.serve.metrics import Tally

    loaded = make_engine(stories, batch=1)
    engine = loaded.engine
    engine.detokenizer = CountingDetokenizer
    stops = ("zzz", "yyyy")  # never found: "abab..." holds neither
    steps = 300
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=steps, ignore_eos=True, stop=stops))
    printed = []
    printer = TextPrinter(loaded.tokenizer, [seq], echo_prompt=False,
                          out=SimpleNamespace(write=printed.append, flush=lambda: None))
    server = EngineProcess.__new__(EngineProcess)  # the engine process's delta, without its pipes
    server.answers, server.requests, server.tally = {seq.id: None}, {}, Tally()
    link, sent = SimpleNamespace(deltas=[]), [0, 0, 0, 0]  # (what engine_process.EngineProcess._add makes)
    per_step = []
    while engine.has_unfinished:
        CountedText.work = 0
        engine.step()
        printer.update(seq)
        printer.flush()
        server._delta(seq, link, 0, 0, sent, 0.0)
        per_step.append(CountedText.work)
    assert len(seq.output_token_ids) == steps
    hold = max(map(len, stops)) - 1
    bound = len(stops) * (2 + hold) + 4 * (2 + hold)  # the searches, and a few copies of the new text
    assert max(per_step) <= bound, f"a step read {max(per_step)} characters for a {2 * steps}-character answer"
    assert "".join(printed).strip() == "".join(d[3] for d in link.deltas) == "ab" * steps


# --- files a user names -------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--prompt-file", "/dev/zero"], "--prompt-file /dev/zero: larger than"),
    (["--chat-template", "/dev/zero", "--chat", "hi"], "--chat-template /dev/zero: larger than"),
])
def test_a_file_that_never_ends_is_one_line_naming_it(args, fragment, monkeypatch):
    """/dev/zero as --chat-template grew a server to 22.8 GB until the kernel killed it; under a
    memory cap, --prompt-file /dev/zero said "out of cpu memory", naming neither file nor option.
    (The bound is lowered here to a MiB: the same code, less to read.)"""
    from pagedcli.model import files

    monkeypatch.setattr(files, "MAX_INPUT_FILE_BYTES", 1 << 20)
    code, _, err = invoke("generate", "-m", "demo", *args)
    assert_one_line(code, err, 2, fragment, "1 MiB, the most a file given here may hold")


def test_standard_input_that_never_ends_is_one_line():
    import subprocess
    import sys

    with open("/dev/zero", "rb") as zeros:
        done = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "-m", "demo", "-"], stdin=zeros,
                              capture_output=True, text=True, timeout=120)
    assert_one_line(done.returncode, done.stderr, 2, "-: standard input: larger than 64 MiB")


def test_a_model_file_that_never_ends_is_one_line(tmp_path, monkeypatch):
    import os
    import shutil

    from pagedcli.model import files

    monkeypatch.setattr(files, "MAX_MODEL_FILE_BYTES", 1 << 20)
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "pagedcli", "data", "demo"), folder)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    code, _, err = invoke("generate", "-m", str(folder), "hi")
    assert_one_line(code, err, 1, "config.json is larger than 1 MiB")


def test_the_real_bound_is_what_the_files_are_read_with():
    from pagedcli.model import files

    assert files.MAX_INPUT_FILE_BYTES == MAX_INPUT_FILE_BYTES == 64 << 20


# --- bench's counts -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--num-prompts", "1000000000"], "--num-prompts 1,000,000,000: more than the 1,000,000 prompts"),
    (["--batch", "1,1000000000"], "--batch 1,000,000,000 (a prompt a slot): more than"),
    (["--input-len", "1:1000000000"], "up to 2,000,000,000 random prompt tokens"),
])
def test_bench_counts_have_upper_bounds_checked_before_anything_runs(args, fragment):
    """Each ran for minutes, memory climbing, drawing its prompts."""
    code, _, err = invoke("bench", "-m", "/nonexistent", *args)
    assert_one_line(code, err, 2, fragment)
    code, _, err = invoke("bench", "--url", "http://127.0.0.1:9", *args)  # before a server is asked
    assert_one_line(code, err, 2, fragment)


# --- serve's own options ------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--api-server-count", "100000"], "--api-server-count 100000: more API processes than this machine's"),
    (["--max-request-size", "lots"], "--max-request-size 'lots' is not a size"),
    (["--engine-timeout", "0"], "--engine-timeout 0.0: must be a positive number of seconds"),
])
def test_serves_bounds_are_checked_before_anything_runs(args, fragment):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    code, _, err = invoke("serve", "-m", "/nonexistent", "--port", "0", *args)
    assert_one_line(code, err, 2, fragment)
