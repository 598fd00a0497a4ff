"""`pagedcli bench`: speed, memory and bandwidth against the hardware's roofline, at one batch size
or a sweep; the measuring is pagedcli.bench's."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from pagedcli.commands import bench_plot
from pagedcli.commands.exits import err, friendly_errors, need_stdout, notice
from pagedcli.commands.options import EngineFlags, flag_group, given_path
from pagedcli.core.errors import UsageError, plural


@friendly_errors
@flag_group(EngineFlags, "engine_flags", leave_out={"batch": 2})  # its own --batch: a list
def bench(
    batch: Annotated[str, typer.Option("--batch", "-b", help="Slots: one value or a list for a sweep, e.g. 1,8,64,256.")] = "2",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: one per slot).")] = None,
    input_len: Annotated[str, typer.Option(help="Prompt tokens: 128, or a range 100:1024 drawn with --seed.")] = "128",
    output_len: Annotated[str, typer.Option(help="New tokens: 256, or a range.")] = "256",
    seed: Annotated[int, typer.Option(help="Seed for random prompts and lengths.")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly the asked lengths.")] = True,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Real prompts, one per line, instead of random ids.",
                                                        parser=given_path)] = None,
    compare: Annotated[Optional[str], typer.Option(help="`hf`: also time transformers' generate, same model and prompts.")] = None,
    kernel: Annotated[bool, typer.Option("--kernel", help="Time the decode attention kernel alone (CUDA).")] = False,
    bandwidth: Annotated[Optional[float], typer.Option(help="Device bandwidth in GB/s (default: measured once, cached).")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Save tokens/s and step time against batch as PNG.",
                                                      parser=given_path)] = None,
    prefix_len: Annotated[int, typer.Option(help="Make the first P prompt tokens the same in every prompt, and time "
                                            "the first token with and without the prefix cache (hits need more "
                                            "prompts than slots: --num-prompts).")] = 0,
    request_rate: Annotated[float, typer.Option(help="Requests a second, arriving as a Poisson process seeded by --seed "
                                                "(vLLM's serving benchmark); inf: all at the start.")] = math.inf,
    quality: Annotated[bool, typer.Option("--quality", help="Measure what fp8, int8 and int4 cost instead of speed: "
                                          "perplexity on held-out text and greedy agreement for the model's dtype, "
                                          "--kv-cache-dtype fp8, --quantization fp8 and both, --quantization int8 and "
                                          "int4 (--num-prompts prompts, default 8, of "
                                          "--output-len greedy tokens).")] = False,
    quality_text: Annotated[Optional[Path], typer.Option(help="With --quality: the held-out text (default: the "
                                                         "built-in model's held-out slice).", parser=given_path)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per batch size on stdout.")] = False,
    json_schema: Annotated[Optional[Path], typer.Option(
        help="Hold every answer to this JSON schema (a file), to time a constrained step against a free one "
        "(run both: the figures side by side).", parser=given_path)] = None,
    url: Annotated[Optional[str], typer.Option(
        help="Drive the OpenAI-compatible server running there (`pagedcli serve`, e.g. http://127.0.0.1:8000) "
        "instead of an engine in this process: the same workloads, --batch streams at once, timed at the client. "
        "--model then only names the model the prompts are drawn for (default: the server's).")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="With --url: the server's key (bearer token).")] = None,
    *, engine_flags: EngineFlags,
):
    """Measure speed, memory and bandwidth against the hardware's roofline."""
    from pagedcli.bench import measure as b
    from pagedcli.bench.bandwidth import measure_bandwidth
    from pagedcli.commands.bench_view import Progress, print_tables, results_table
    from pagedcli.engine.build import load_model

    need_stdout("the figures")
    batches = _int_list(batch, "--batch")
    if compare not in (None, "hf"):
        raise UsageError(f"--compare {compare!r} is not known", "use --compare hf")
    if prefix_len < 0:
        raise UsageError(f"--prefix-len {prefix_len}: must be 0 or more")
    if prefix_len and prompt_file is not None:
        raise UsageError("--prefix-len makes random prompts share a prefix, so it cannot apply to --prompt-file",
                         "leave one of them out (a file's prompts share what they share)")
    if num_prompts is not None and num_prompts < 1:
        raise UsageError(f"--num-prompts {num_prompts}: must be at least 1", "leave it out for one per slot")
    if not request_rate > 0:  # (NaN fails it too)
        raise UsageError(f"--request-rate {request_rate}: must be a positive number of requests a second",
                         "leave it out to send every request at the start")
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        raise UsageError(f"--bandwidth {bandwidth}: must be a positive number of GB/s", "leave it out to measure it")
    structured = None
    if json_schema is not None and (engine_flags.model or "").startswith("random:"):
        raise UsageError(f"--json-schema: --model {engine_flags.model} has no tokenizer, so no text to hold to a schema",
                         "give a model folder or Hub name")
    if json_schema is not None:
        from pagedcli.model.files import read_given_text

        structured = ("json", read_given_text(json_schema, f"--json-schema {json_schema}", "give a JSON schema file"))
    workload = b.Workload(num_prompts, input_len, output_len, seed, ignore_eos, prompt_file, prefix_len, request_rate,
                          structured)
    b.parse_len(input_len, "--input-len"), b.parse_len(output_len, "--output-len")
    if not quality:
        b.check_counts(workload, batches)
    # each of these loads or runs a model outside the engine, on one device
    one_device = [flag for flag, given in (("--quality", quality), ("--kernel", kernel), ("--compare hf", compare == "hf"))
                  if given]
    if engine_flags.tensor_parallel_size > 1 and one_device:
        raise UsageError(f"{one_device[0]} runs on one device", "leave out --tensor-parallel-size")
    if quality:
        speed_only = {"--batch": batch != "2", "--input-len": input_len != "128", "--prompt-file": prompt_file,
                      "--request-rate": math.isfinite(request_rate), "--compare": compare, "--kernel": kernel,
                      "--plot": plot_file, "--prefix-len": prefix_len, "--url": url, "--bandwidth": bandwidth}
        for flag, given in speed_only.items():
            if given:
                raise UsageError(f"{flag} is for the speed bench; --quality measures perplexity and greedy agreement",
                                 f"leave out {flag}, or --quality")
        _quality_bench(engine_flags, quality_text, num_prompts, output_len, json_output)
        return
    if quality_text is not None:
        raise UsageError("--quality-text is the held-out text of --quality", "give --quality too")
    if url is not None:
        _in_process_only(engine_flags, {"--compare": compare, "--kernel": kernel or None, "--bandwidth": bandwidth,
                                        "--plot": plot_file})
        _bench_served(url, api_key, batches, workload, engine_flags.model, json_output)
        return
    if api_key is not None:
        raise UsageError("--api-key is the key of a server bench drives", "give --url too, or leave --api-key out")
    if plot_file is not None:
        plot_file = bench_plot.plot_path(plot_file)
    opts = engine_flags.options(batch=max(batches))
    loaded = load_model(opts, notice)
    if kernel:
        _kernel_bench(loaded, json_output, bandwidth, opts.kv_cache_dtype)
        return
    results, told = [], set()

    def notice_once(text: str) -> None:  # each batch size builds an engine: say a fallback once
        if text not in told:
            told.add(text)
            notice(text)

    if loaded.device.type == "cpu":
        runs = 1 + bool(prefix_len and opts.prefix_caching) + (compare == "hf")
        _announce(loaded, opts, workload, batches, runs, notice_once)
    gbps = bandwidth or measure_bandwidth(loaded.device)
    hf = None
    if compare == "hf":
        from pagedcli.bench.hf import hf_model

        hf = hf_model(loaded)
    try:
        with Progress(err) as progress:
            for n in batches:
                results.append(b.run_point(loaded, opts, n, workload, gbps, progress.task(f"batch {n}"), hf,
                                           notice_once))
                if json_output:
                    print(json.dumps(results[-1]), flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the batch sizes that finished are kept (JSON: printed already)
        if results and not json_output:
            print_tables(results_table(results))
        raise
    if not json_output:
        print_tables(results_table(results))
    if plot_file is not None:
        bench_plot.plot(results, plot_file)
        notice(f"plot saved to {plot_file}")


def _in_process_only(engine_flags: EngineFlags, given: dict) -> None:
    """With --url the server's engine runs: a flag that sets up or measures one in this process would
    be silently ignored, so it is refused (--model stays: it names the prompts' vocabulary)."""
    from pagedcli.commands.options import FLAGS

    for field in dataclasses.fields(EngineFlags):
        if field.name not in ("model", "batch") and getattr(engine_flags, field.name) != field.default:
            given[FLAGS[field.name]] = getattr(engine_flags, field.name)
    for flag, value in given.items():
        if value is not None:
            raise UsageError(f"{flag} is for the in-process bench; with --url the server's engine runs",
                             "set the engine's options on `pagedcli serve`, or leave --url out")


def _bench_served(url: str, api_key: str | None, batches: list[int], workload, model: str | None,
                  json_output: bool) -> None:
    """bench --url: each batch size's figures from the server (pagedcli.bench.served)."""
    from pagedcli.bench import served
    from pagedcli.commands.bench_view import Progress, print_tables, served_table

    results = []

    def each(result: dict) -> None:
        results.append(result)
        if json_output:
            print(json.dumps(result), flush=True)

    try:
        with Progress(err) as progress:
            served.run(url, api_key, batches, workload, model, lambda n: progress.task(f"batch {n}", "{:,} answered"),
                       notice, each)
    except KeyboardInterrupt:  # as in-process: the batch sizes that finished are kept
        if results and not json_output:
            print_tables(served_table(results))
        raise
    if not json_output:
        print_tables(served_table(results))


def _announce(loaded, opts, workload, batches: list[int], runs: int, say) -> None:
    """A run long enough to wonder about (on a CPU) says first how long it may take, from what the
    model's own steps cost here (estimate.time_steps)."""
    from pagedcli.bench import estimate

    step_s, token_s = estimate.time_steps(loaded, opts, workload, batches, say)
    seconds, tokens, steps = estimate.estimate_seconds(loaded, workload, batches, step_s, token_s, runs)
    if seconds > estimate.ANNOUNCE_S:
        notice(f"this may take {duration(seconds)} here: a step of {loaded.source.name} took {1e3 * step_s:,.0f} ms, "
               f"and {1e3 * token_s:,.1f} ms more for each further token it feeds; the run feeds "
               f"{plural(tokens, 'token')} in {plural(steps, 'step')} (a smaller --batch list, --num-prompts, "
               f"--output-len or model is quicker; Ctrl-C keeps the batch sizes that finished)")


def duration(seconds: float) -> str:
    """'about 40 s', 'about 25 min', 'about 3.5 h'."""
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def _quality_bench(engine_flags: EngineFlags, text_path: Path | None, num_prompts: int | None, output_len: str,
                   json_output: bool) -> None:
    from dataclasses import asdict

    from pagedcli.bench import measure as b
    from pagedcli.bench.quality import DEFAULT_PROMPTS, measure_quality
    from pagedcli.commands.bench_view import print_tables, quality_table

    num_prompts = num_prompts or DEFAULT_PROMPTS
    lo, hi = b.parse_len(output_len, "--output-len")
    if lo != hi:
        raise UsageError(f"--output-len {output_len}: --quality compares one length of greedy tokens", "give one number")
    if engine_flags.kv_cache_dtype != "auto" or engine_flags.quantization != "none":
        raise UsageError("--quality measures every fp8, int8 and int4 option itself", "leave out --kv-cache-dtype and --quantization")
    opts = engine_flags.options()
    told = set()

    def notice_once(text: str) -> None:  # each option loads the model again: say a notice once
        if text not in told:
            told.add(text)
            notice(text)

    rows, model = measure_quality(opts, text_path, num_prompts, lo, notice_once, lambda v: notice(f"measuring {v}"))
    name, device = model.source.name, model.device.type
    dtype = str(model.dtype).removeprefix("torch.")
    if json_output:
        for r in rows:
            print(json.dumps(asdict(r) | {"model": name, "baseline_dtype": dtype, "device": device, "num_tokens": lo}),
                  flush=True)
    else:
        print_tables(quality_table(rows, name, dtype, device, lo))


def _kernel_bench(loaded, json_output: bool, bandwidth: float | None, kv_cache_dtype: str) -> None:
    if loaded.device.type != "cuda":
        raise UsageError("--kernel times our CUDA kernel", "run it on a machine with an NVIDIA GPU and CuPy")
    from pagedcli.bench.bandwidth import measure_bandwidth
    from pagedcli.bench.kernel import bench_decode_kernel
    from pagedcli.commands.bench_view import kernel_table, print_tables
    from pagedcli.core.fp8 import FP8_DTYPE

    c = loaded.source.config
    rows = bench_decode_kernel([1, 8, 64], [512, 4096], head_dim=c.head_dim, num_heads=c.num_heads,
                               num_kv_heads=c.num_kv_heads, dtype=loaded.dtype,
                               cache_dtype=FP8_DTYPE if kv_cache_dtype == "fp8" else None)
    if json_output:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        print_tables(kernel_table(rows, bandwidth or measure_bandwidth(loaded.device)))


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a number or a list of numbers", "e.g. 1,8,64") from None
    if not values or min(values) < 1:
        raise UsageError(f"{name} {text!r}: needs numbers of at least 1")
    return values
