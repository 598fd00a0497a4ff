"""The command line at its edges (issue 51): standard output closed or unable to hold the text,
Ctrl-C while the modules still import, COLUMNS=0, stderr on a full disk, empty values, a weights
file that is a device, and the counts with upper bounds. One clear line and the right exit code, or
a correct result; never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from helpers import assert_one_line, invoke
from pagedcli.core.options import MAX_N

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pagedcli(*args, input: str | None = None, env: dict | None = None, close_stdout: bool = False):
    """`python -m pagedcli ARGS` as a process: (exit code, stdout, stderr)."""
    def prepare():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a suite in a shell's background job inherits it ignored)
        if close_stdout:
            os.close(1)

    done = subprocess.run([sys.executable, "-m", "pagedcli", *args], input=input, capture_output=not close_stdout,
                          stderr=subprocess.PIPE if close_stdout else None, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, **(env or {})), preexec_fn=prepare)
    return done.returncode, done.stdout or "", done.stderr


# --- standard output ----------------------------------------------------------------------------
@pytest.mark.parametrize("args, stdin", [
    (["generate", "-m", "demo", "--max-tokens", "3", "ROMEO:"], None),
    (["generate", "-m", "demo", "--max-tokens", "3", "--json", "ROMEO:"], None),
    (["chat", "-m", "demo", "--chat-template", "tests/assets/chat/chat_template.jinja", "--max-tokens", "3"], "hi\n"),
], ids=["text", "json", "chat"])
def test_a_closed_stdout_is_one_line_before_the_model_loads(args, stdin):
    """It was AttributeError: 'NoneType' object has no attribute 'write' (output.py), after the load."""
    code, _, err = pagedcli(*args, input=stdin, close_stdout=True)
    assert_one_line(code, err, 1, "standard output is closed", "/dev/null")


def test_an_output_encoding_that_cannot_hold_the_text_escapes_it(stories):
    """PYTHONIOENCODING=ascii (or latin-1) and a prompt in another script: a UnicodeEncodeError at
    the first write. The text now comes with Python's escapes; --json with JSON's, the same JSON."""
    runner = CliRunner(charset="ascii")
    from pagedcli.commands.app import app

    prompt = "日本 ROMEO"
    result = runner.invoke(app, ["generate", "-m", str(stories), "--raw", "--max-tokens", "3", prompt])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("\\u65e5\\u672c ROMEO")
    result = runner.invoke(app, ["generate", "-m", str(stories), "--raw", "--max-tokens", "3", "--json", prompt])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt"] == prompt and "\\u65e5" in result.stdout


# --- signals and the terminal -------------------------------------------------------------------
def test_ctrl_c_while_the_modules_import_is_130_without_a_traceback():
    """The SIGINT arrives as Typer is imported (deterministically: an import hook sends it): it was a
    KeyboardInterrupt traceback, and the process ended by the signal (status -2)."""
    code = textwrap.dedent("""
        import os, runpy, signal, sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "typer":
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, Interrupt())
        sys.argv = ["pagedcli", "generate", "-m", "demo", "hi"]
        runpy.run_module("pagedcli", run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "interrupted" in done.stderr


def test_columns_0_still_shows_every_line():
    """rich took COLUMNS=0 for a width of 0 and cut every stderr line to nothing (exit codes stayed)."""
    code, _, err = pagedcli("generate", "-m", "demo", "--n", "0", "hi", env={"COLUMNS": "0"})
    assert_one_line(code, err, 2, "--n 0: must be from 1")


def test_a_usage_error_with_stderr_on_a_full_disk_still_exits_2(monkeypatch):
    """The line cannot be written (ENOSPC): the exit code must still say what happened (it was 1)."""
    from pagedcli.commands import exits

    class Full:
        def write(self, _text):
            raise OSError(28, "No space left on device")

        def flush(self):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(exits.err, "_file", Full())
    code, out, _ = invoke("generate", "-m", "demo", "--n", "0", "hi")
    assert code == 2
    code, out, _ = invoke("generate", "-m", "demo", "--no-such-flag", "hi")  # Click's own usage errors too
    assert code == 2


# --- values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--cache-size", "", "hi"], "--cache-size '' is not a size"),
    (["--prompt-file", ""], "'--prompt-file': '' names no file"),
    (["--chat-template", "", "hi"], "'--chat-template': '' names no file"),
])
def test_an_empty_value_is_named_not_taken_for_the_default_or_the_folder_dot(args, fragment):
    """--cache-size '' silently meant the default; an empty file name was the folder `.`."""
    code, _, err = invoke("generate", "-m", "demo", *args)
    assert_one_line(code, err, 2, fragment)


def test_a_weights_file_that_is_a_device_is_not_called_missing(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(REPO, "pagedcli", "data", "demo"), folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/dev/zero")
    code, _, err = invoke("generate", "-m", str(folder), "hi")
    assert_one_line(code, err, 1, "model.safetensors is not a regular file")


def test_n_has_an_upper_bound_checked_before_anything_runs():
    """--n 1000000000 ran: memory climbed for minutes. The bound is the server's (`n` at most 128)."""
    code, _, err = invoke("generate", "-m", "/nonexistent", "--n", str(MAX_N + 1), "hi")
    assert_one_line(code, err, 2, f"--n {MAX_N + 1}: must be from 1 to {MAX_N}")
    from pagedcli.serve import sampling

    assert sampling.MAX_N == MAX_N  # one bound, declared once (core/options.py)
