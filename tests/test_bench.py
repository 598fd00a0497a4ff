"""bench: the JSON contract and the arithmetic behind the roofline."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import hf_checkpoint
from pagedcli.bench.measure import decode_step_bytes, decode_weight_bytes, make_requests, parse_len, Workload
from pagedcli.commands.app import app
from pagedcli.model.config import CacheGeometry
from pagedcli.errors import UsageError
from pagedcli.model.loader import EngineOptions, load_model
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
    (["--input-len", "1000"], "make requests of up to 1008 tokens, more than the maximum length"),
    (["--output-len", "1000"], "--output-len 1000 make requests of up to 1008 tokens"),
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
