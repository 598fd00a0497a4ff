"""bench: the JSON contract and the arithmetic behind the roofline."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import hf_checkpoint
from pagedcli.bench.measure import decode_step_bytes, decode_weight_bytes, make_requests, parse_len, Workload
from pagedcli.commands.app import app
from pagedcli.core.geometry import CacheGeometry
from pagedcli.core.errors import UsageError
from pagedcli.engine.build import load_model
from pagedcli.core.options import EngineOptions
from pagedcli.model.source import resolve_model

KEYS = {"batch", "num_prompts", "input_len", "output_len", "elapsed_s", "requests_per_s", "output_tokens_per_s",
        "prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "itl_ms", "decode_step_ms", "roofline_step_ms",
        "achieved_gb_per_s", "roofline_fraction", "kv_blocks_total", "kv_blocks_peak", "kv_bytes_peak",
        "kv_bytes_contiguous", "gpu_memory_peak_bytes", "device", "dtype", "model"}


def test_llama_1b_roofline_bytes_per_step():
    """2.47 GB of bf16 weights (tied head read once) plus 32 KiB of K+V per cached token."""
    config = resolve_model("random:llama-3.2-1b").config
    weight_bytes = config.num_parameters * 2
    assert weight_bytes == 2_471_628_800
    geometry = CacheGeometry.build(config, torch.bfloat16, 16, num_blocks=1024)
    assert geometry.kv_bytes_per_token == 32 * 1024 and geometry.block_bytes == 32 * 1024
    contexts = [128 + 256] * 64
    assert decode_step_bytes(weight_bytes, geometry.kv_bytes_per_token, contexts) == 2_471_628_800 + 64 * 384 * 32768
    # batch 1: the weights dominate; at the measured 4.29 TB/s the floor is ~0.58 ms (~1,735 tokens/s)
    step_s = decode_step_bytes(weight_bytes, geometry.kv_bytes_per_token, [384]) / 4.29e12
    assert 0.57e-3 < step_s < 0.59e-3


def test_untied_embedding_is_looked_up_not_read(tmp_path):
    tied = load_model(EngineOptions(model=str(hf_checkpoint(tmp_path / "t")), device="cpu"))
    untied = load_model(EngineOptions(model=str(hf_checkpoint(tmp_path / "u", tie_word_embeddings=False)),
                                      device="cpu"))
    assert decode_weight_bytes(tied) == tied.weights.nbytes
    embed = untied.weights.embed
    assert decode_weight_bytes(untied) == untied.weights.nbytes - embed.numel() * embed.element_size()
    assert decode_weight_bytes(untied) == decode_weight_bytes(tied)


def test_length_ranges_are_drawn_with_the_seed():
    assert parse_len("128", "x") == (128, 128) and parse_len("100:1024", "x") == (100, 1024)
    for bad in ("0", "5:3", "abc", "1:x"):
        with pytest.raises(UsageError):
            parse_len(bad, "--input-len")
    w = Workload(input_len="10:20", output_len="3:9", seed=5)
    a, b = make_requests(w, 8, 100, {0, 1}), make_requests(w, 8, 100, {0, 1})
    assert a == b and all(10 <= len(r.prompt_token_ids) <= 20 and 3 <= r.max_tokens <= 9 for r in a)
    assert all(t not in (0, 1) for r in a for t in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in a}) > 1


def test_bench_json_contract_on_cpu(stories):
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--batch", "1,3", "--num-prompts", "4",
                                 "--input-len", "4:20", "--output-len", "6", "--json", "--bandwidth", "10"])
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert KEYS <= set(row)
        assert row["num_prompts"] == 4 and row["device"] == "cpu" and row["dtype"] == "float32"
        assert row["gpu_memory_peak_bytes"] is None
        assert set(row["ttft_ms"]) == set(row["itl_ms"]) == {"mean", "p50", "p99"}
        assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        assert 0 < row["roofline_fraction"] <= 1
        assert row["output_tokens_per_s"] == pytest.approx(4 * 6 / row["elapsed_s"])
        assert row["kv_bytes_peak"] == row["kv_blocks_peak"] * 4096  # stories260K: 2 x 16 x 32 x 4 bytes
        assert 0 < row["kv_bytes_peak"] < row["kv_bytes_contiguous"]
        assert row["bandwidth_gb_per_s"] == 10
    assert rows[1]["kv_blocks_peak"] > rows[0]["kv_blocks_peak"]  # three sequences held at once


def test_bench_table_renders(stories):
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--batch", "2", "--output-len", "4",
                                 "--input-len", "8", "--bandwidth", "10"])
    assert r.exit_code == 0, r.stderr
    assert "of" in r.stdout and "roofline" in r.stdout and "KV cache" in r.stdout


def test_kernel_bench_needs_cuda(stories):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--kernel", "--device", "cpu"])
    assert r.exit_code == 2 and "--kernel" in r.stderr


def test_plot_is_written(stories, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--batch", "1,2", "--output-len", "4",
                                 "--input-len", "8", "--bandwidth", "10", "--plot", str(png)])
    assert r.exit_code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, fragment", [
    (["--input-len", "1000"], "make requests of up to 1,008 tokens, more than the maximum length"),
    (["--output-len", "1000"], "--output-len 1000 make requests of up to 1,008 tokens"),
    (["--num-prompts", "0"], "--num-prompts 0: must be at least 1"),
    (["--bandwidth", "-5"], "--bandwidth -5.0: must be a positive number"),
    (["--plot", "/nonexistent-folder/x.png"], "--plot /nonexistent-folder/x.png: no folder"),
])
def test_a_workload_the_engine_would_cut_short_or_cannot_report_is_refused(stories, args, fragment):
    """Before any timing (the figures would be mislabelled, or lost at the end)."""
    base = {"--input-len": "8", "--output-len": "8"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--batch", "1",
                                 *[x for kv in base.items() for x in kv]])
    assert r.exit_code == 2 and fragment in r.stderr, r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1


def test_plot_name_without_suffix_is_saved_as_png(stories, tmp_path):
    pytest.importorskip("matplotlib")
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--batch", "1", "--output-len", "4",
                                 "--input-len", "8", "--bandwidth", "10", "--plot", str(tmp_path / "chart")])
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "chart.png").is_file() and f"plot saved to {tmp_path / 'chart.png'}" in r.stderr


def bench(*args):
    r = CliRunner().invoke(app, ["bench", *args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


SMALL = ["--batch", "1,4", "--input-len", "8", "--output-len", "6", "--bandwidth", "10"]


def test_the_estimate_of_the_issues_cpu_sweep():
    """random:llama-3.2-1b at --batch 1,64,256 (the issue's run), from what a step costs: one step
    a token generated plus a prefill a wave and the warm-up's four, and token_s for each token fed
    beyond a step's first. No model is built: the estimate reads the config and the workload."""
    from types import SimpleNamespace

    from pagedcli.bench.estimate import estimate_seconds

    model = SimpleNamespace(source=resolve_model("random:llama-3.2-1b"), tokenizer=None)
    seconds, tokens, steps = estimate_seconds(model, Workload(), [1], step_s=1.0, token_s=0.03)
    fed = 128 + 128 + 3 + 255  # the prompt, the warm-up's prompt and its three decode steps, 255 decode steps
    assert (tokens, steps) == (fed, 4 + 1 + 255) and seconds == pytest.approx(260 + (fed - 260) * 0.03)
    seconds, tokens, steps = estimate_seconds(model, Workload(), [1, 64, 256], step_s=1.0, token_s=0.03)
    assert steps == 3 * 260 and tokens == sum(b * (128 + 128 + 3 + 255) for b in (1, 64, 256))
    assert seconds == pytest.approx(steps + (tokens - steps) * 0.03)
    twice, _, _ = estimate_seconds(model, Workload(), [1, 64, 256], 1.0, 0.03, runs=2)  # --compare hf
    assert twice == pytest.approx(2 * seconds)


def test_a_long_cpu_run_says_how_long_before_it_starts(stories, monkeypatch):
    from pagedcli.bench import estimate

    monkeypatch.setattr(estimate, "time_steps", lambda *_: (5.0, 0.05))  # as if each step took 5 s
    r = bench("--model", str(stories), *SMALL)
    assert r.exit_code == 0, r.stderr
    announced = next(i for i, line in enumerate(r.stderr.splitlines()) if line.startswith("this may take"))
    first_progress = next(i for i, line in enumerate(r.stderr.splitlines()) if line.startswith("batch 1:"))
    assert announced < first_progress
    seconds, tokens, steps = estimate.estimate_seconds(load_model(EngineOptions(model=str(stories), device="cpu")),
                                                      Workload(input_len="8", output_len="6"), [1, 4], 5.0, 0.05)
    assert f"this may take about {seconds / 60:.0f} min here" in r.stderr and "took 5,000 ms" in r.stderr
    assert f"the run feeds {tokens:,} tokens in {steps:,} steps" in r.stderr
    monkeypatch.undo()
    r = bench("--model", str(stories), *SMALL)  # a run of a second or two: not announced
    assert r.exit_code == 0 and "this may take" not in r.stderr


def test_progress_goes_step_by_step_and_shows_without_a_terminal(stories, monkeypatch):
    from pagedcli.commands import bench_view

    monkeypatch.setattr(bench_view, "PLAIN_EVERY_S", 0.0)  # a line at every step
    r = bench("--model", str(stories), *SMALL, "--json")
    assert r.exit_code == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("batch 4:")]
    done = [int(line.split()[2].split("/")[0].replace(",", "")) for line in lines]
    assert len(lines) > 5 and done == sorted(done) and done[0] == 0 and lines[-1].startswith("batch 4: 24/24 tokens")
    assert len([json.loads(line) for line in r.stdout.splitlines()]) == 2  # stdout stays JSON


def test_ctrl_c_keeps_the_batch_sizes_that_finished(stories, monkeypatch):
    from pagedcli.bench import measure

    run_point = measure.run_point

    def interrupted_at_batch_4(model, opts, batch, *args, **kwargs):
        if batch == 4:
            raise KeyboardInterrupt
        return run_point(model, opts, batch, *args, **kwargs)

    monkeypatch.setattr(measure, "run_point", interrupted_at_batch_4)
    r = bench("--model", str(stories), *SMALL)
    assert r.exit_code == 130 and r.stderr.strip().splitlines()[-1] == "interrupted"
    rows = [line.split() for line in r.stdout.splitlines()]
    assert "roofline" in r.stdout and "KV cache" in r.stdout  # both tables
    assert [row[0] for row in rows if row and row[0].isdigit()] == ["1", "1"]  # batch 1's rows, not batch 4's
    r = bench("--model", str(stories), *SMALL, "--json")
    assert r.exit_code == 130 and [json.loads(line)["batch"] for line in r.stdout.splitlines()] == [1]


def test_tables_are_not_cut_when_piped(stories):
    import io

    from rich.console import Console

    from pagedcli.commands.bench_view import print_tables, results_table

    r = bench("--model", str(stories), *SMALL, "--json")
    results = [json.loads(line) for line in r.stdout.splitlines()]
    for row in results:
        row["model"] = "a-model-with-a-name-that-is-long/" + "x" * 60
        row["decode_tokens_per_s"] = row["output_tokens_per_s"] = 123456789.0
    piped = Console(file=io.StringIO())  # not a terminal: Rich's 80 columns
    print_tables(results_table(results), piped)
    out = piped.file.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) > 80  # cut at 80 columns, the numbers had "…"
    assert results[0]["model"] in out.replace("\n", "")  # a title longer than its table wraps
    assert out.count("123,456,789") == 2 * len(results)  # each row whole, on one line
    assert all(line.count("123,456,789") in (0, 2) for line in out.splitlines())


def test_plot_without_matplotlib_is_refused_before_the_benchmark(stories, monkeypatch, tmp_path):
    import sys

    from pagedcli.engine import build as loader

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, as when it is not installed

    def not_now(*_args, **_kwargs):
        raise AssertionError("the model was loaded before --plot was checked")

    monkeypatch.setattr(loader, "load_model", not_now)
    r = bench("--model", str(stories), "--plot", str(tmp_path / "b.png"))
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "--plot needs matplotlib" in r.stderr and 'pip install "pagedcli[plot]"' in r.stderr


def test_the_progress_bar_on_a_terminal_counts_tokens_and_steps():
    import io

    from rich.console import Console

    from pagedcli.commands.bench_view import Progress, StepsColumn

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    with Progress(console) as progress:
        update = progress.task("batch 64")
        task = progress.bar.tasks[0]
        assert str(StepsColumn().render(task)) == "building the engine"
        update(0, 16_384, 0)
        update(1_280, 16_384, 21)
        assert str(StepsColumn().render(task)) == "1,280/16,384 tokens, step 21"
    assert "tokens, step" in console.file.getvalue()
