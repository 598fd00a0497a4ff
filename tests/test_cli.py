"""The command line as a user runs it: output, JSON contract, exit codes, messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import invoke

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def run(*args):
    return invoke("generate", *args)


def test_the_readme_story_command(stories):
    """The issue's acceptance command, run as a real process through `python -m pagedcli`."""
    out = subprocess.run([sys.executable, "-m", "pagedcli", "generate", "--model", str(stories), "--raw",
                          "--temperature", "0", "--max-tokens", "60", "Once upon a time"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(STORY)
    assert "tokens/s" in out.stderr


def test_json_is_one_object_per_prompt_in_input_order(stories, tmp_path):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("Tom and his dog\n\nThe sun\n", encoding="utf-8")
    code, stdout, _ = run("--model", str(stories), "--json", "--max-tokens", "12", "--batch", "2",
                          "Once upon a time", "--prompt-file", str(prompt_file), "A\u2028line\x85apart")
    assert code == 0
    # (one record a line for a reader that splits as str.splitlines does, U+2028 and U+0085 too)
    records = [json.loads(line) for line in stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Once upon a time", "A\u2028line\x85apart", "Tom and his dog",
                                               "The sun"]
    for r in records:
        assert set(r) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert r["prompt_token_ids"][0] == 1 and len(r["token_ids"]) <= 12
        assert r["finish_reason"] in ("stop", "length")
    assert records[0]["text"].startswith(", there was a little girl named Lily")


def test_several_prompts_are_labelled_and_not_interleaved(stories):
    long = "Tom and his dog went to the park to play with a big red ball"
    code, stdout, stderr = run("--model", str(stories), "--max-tokens", "8", "Once upon a time", long)
    assert code == 0
    first, second = stdout.index("[1] Once upon a time, there was"), stdout.index(f"[2] {long}")
    assert first < second
    assert stdout.count(long) == 1, "the prompt is printed once: echoed after its label, not in it too"
    assert "2 prompts" in stderr and "answers" not in stderr


def test_answers_of_one_prompt_are_counted_as_answers(stories):
    code, stdout, stderr = run("--model", str(stories), "--max-tokens", "3", "--n", "4", "--temperature", "1",
                               "--seed", "1", "Once upon a time")
    assert code == 0 and stdout.count("Once upon a time") == 4 and "[1.4] Once upon a time" in stdout
    assert "1 prompt, 4 answers" in stderr and "4 prompts" not in stderr


def test_counts_are_in_the_right_number(stories):
    code, _, stderr = run("--model", str(stories), "--max-tokens", "1", "--ignore-eos", "Once upon a time")
    # "1 tokens" as a count, not inside a rate such as "385.1 tokens/s"
    assert code == 0 and "1 token in" in stderr and not re.search(r"(?<![\d.,])1 tokens", stderr) and "1 prompt" in stderr
    from pagedcli.core.errors import plural

    assert (plural(1, "token"), plural(0, "block"), plural(2048, "token")) == ("1 token", "0 blocks", "2,048 tokens")


def test_quiet_prints_only_the_answers(stories):
    args = ("--model", str(stories), "--raw", "--max-tokens", "6", "--ignore-eos", "Once upon a time", "Tom and his dog")
    code, stdout, stderr = run("--quiet", *args)
    assert code == 0 and stderr == ""
    _, loud, _ = run(*args)
    answers = stdout.splitlines()
    assert len(answers) == 2 and "[" not in stdout and "Once upon a time" not in stdout
    assert f"Once upon a time{answers[0]}" in loud and f"Tom and his dog{answers[1]}" in loud
    code, stdout, stderr = run("-q", "--model", str(stories), "--max-tokens", "0", "x")  # errors still say why
    assert code == 2 and stdout == "" and stderr.startswith("error: --max-tokens 0")
    # a refused prompt among others: its line stays empty (line n is still prompt n's answer), no mark
    code, stdout, stderr = run("-q", *args[:-2], "Once upon a time", "Lily " * 600, "Tom and his dog")
    assert code == 2 and "[error]" not in stdout and "prompt 2" in stderr
    assert stdout.splitlines() == [answers[0], "", answers[1]]


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1", "x"], "--temperature -1.0"),
    (["--top-p", "0", "x"], "--top-p 0.0"),
    (["--top-p", "1.5", "x"], "--top-p 1.5"),
    (["--top-k", "-2", "x"], "--top-k -2"),
    (["--max-tokens", "0", "x"], "--max-tokens 0"),
    ([], "no prompt given"),
])
def test_bad_sampling_options_are_usage_errors(stories, args, message):
    code, stdout, stderr = run("--model", str(stories), *args)
    assert code == 2 and message in stderr and "Traceback" not in stderr and stdout == ""


def test_a_failed_prompt_does_not_stop_the_others(stories):
    code, stdout, stderr = run("--model", str(stories), "--json", "--max-tokens", "5", "--max-model-len", "20",
                               "Once upon a time", "a " * 40, "The cat")
    records = [json.loads(line) for line in stdout.splitlines()]
    assert code == 2 and "prompt 2" in stderr
    assert [r["finish_reason"] for r in records] == ["length", "error", "length"]


def test_non_utf8_prompt_file(stories, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café\n".encode("latin-1"))
    code, _, stderr = run("--model", str(stories), "--prompt-file", str(bad))
    assert code == 2 and "not UTF-8" in stderr


def test_missing_model_folder(tmp_path):
    code, _, stderr = run("--model", str(tmp_path / "missing"), "hi")
    assert code == 2 and "no such folder" in stderr and "Traceback" not in stderr


def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, stderr = run("--device", "cuda", "--model", "demo", "hi")
    assert code == 2 and "--device cuda" in stderr and "pagedcli[cuda]" in stderr
    assert len(stderr.strip().splitlines()) == 1


def commands() -> list[str]:
    """Every command the app has, whoever added it."""
    import typer.main

    from pagedcli.commands.app import app

    return sorted(typer.main.get_command(app).commands)


COMMANDS = commands()


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_shows_flags_as_flags_and_h_is_help(command):
    code, stdout, _ = invoke(*command, "-h")
    _, long_help, _ = invoke(*command, "--help")
    assert code == 0 and stdout == long_help and "Usage:" in stdout
    assert "<bool>" not in stdout, "a flag is shown as taking a value"
    if command in (["generate"], ["inspect-cache"], ["bench"]):
        assert "--json" in stdout


def test_the_app_alone_shows_its_help():
    code, stdout, stderr = invoke()
    assert code == 2 and "Usage:" in stdout and "generate" in stdout and "error" not in stderr


def test_version():
    from pagedcli import __version__

    for flag in ("--version", "-V"):
        code, stdout, _ = invoke(flag)
        assert code == 0 and stdout == f"pagedcli {__version__}\n"


@pytest.mark.parametrize("args, fragments", [
    (["generate", "--halt-at", "x"], ["no such option --halt-at", "generate --help` lists the options"]),
    (["generate", "--max-token", "3", "x"], ["no such option --max-token", "did you mean --max-tokens?"]),
    (["generate", "--temprature", "1", "x"], ["did you mean --temperature?"]),
    (["bench", "--plott", "x"], ["did you mean --plot?"]),
    (["generate", "--max-tokens"], ["--max-tokens", "requires an argument"]),
    (["generate", "--max-tokens", "many", "x"], ["invalid value for '--max-tokens'"]),
    (["--bogus"], ["no such option --bogus"]),
    (["nonesuch"], ["no such command 'nonesuch'", "lists the commands"]),
])
def test_clicks_own_usage_errors_are_one_line(args, fragments):
    code, stdout, stderr = invoke(*args)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: "), stderr
    assert "╭" not in stderr and "Possible options" not in stderr
    for f in fragments:
        assert f in stderr, stderr


def test_only_really_close_options_are_suggested():
    """Click offers --json, --top-k and --top-p for --stop; a close spelling, or a name begun, is a
    suggestion, a shared letter or two is not."""
    from pagedcli.commands.usage import close_options

    from types import SimpleNamespace

    def Ctx(options):  # a context's command, as much of it as close_options reads
        params = [SimpleNamespace(param_type_name="option", hidden=False, opts=(o,), secondary_opts=()) for o in options]
        return SimpleNamespace(command=SimpleNamespace(get_params=lambda _ctx: params))

    ctx = Ctx(["--json", "--top-k", "--top-p", "--max-tokens", "--max-model-len", "--seed"])
    assert close_options("--stop", ctx) == []
    assert close_options("--max-token", ctx) == ["--max-tokens"]
    assert close_options("--max", ctx) == ["--max-tokens", "--max-model-len"]
    assert close_options("--seeds", ctx) == ["--seed"]


def test_no_folder_of_the_checkout_shadows_an_installed_package():
    """`python -m pytest` (and `python -m pagedcli`) run from the checkout put it first on sys.path,
    so each top-level folder with an __init__.py imports by its name ahead of site-packages (the CUDA
    sources' `kernels/` once had one, and transformers then imported it for Hugging Face's `kernels`
    package). No installed distribution may provide a name one of our folders takes; `kernels/` has
    no __init__.py: a namespace portion, which an installed regular package of that name outranks."""
    import importlib.metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ours = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} - {"pagedcli"}
    installed = importlib.metadata.packages_distributions()
    clashes = {name: installed[name] for name in ours if name in installed}
    assert not clashes, f"top-level folders named like installed packages: {clashes}"
    assert "kernels" not in ours and (root / "kernels" / "geometry.cuh").is_file()


def test_the_cuda_sources_are_found_from_a_checkout_an_editable_install_and_a_wheel(tmp_path):
    """kernels/ (top level, no __init__.py) is found beside pagedcli/ in a checkout and in this
    editable install run from elsewhere, and as pagedcli/kernels/ inside the wheel's install."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    where = "from pagedcli.backends.cuda_compile import kernel_folder; print(kernel_folder())"

    def folder(cwd, path=None) -> Path:
        env = dict(os.environ, PYTHONPATH=str(path)) if path else dict(os.environ)
        done = subprocess.run([sys.executable, "-c", where], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip())

    assert folder(root) == folder(tmp_path) == root / "kernels"
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(root)], capture_output=True, text=True)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                              *map(str, (tmp_path / "dist").glob("*.whl"))], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    installed = folder(tmp_path, target)
    assert installed == target / "pagedcli" / "kernels"
    assert {p.name for p in installed.iterdir()} == {p.name for p in (root / "kernels").iterdir()}
