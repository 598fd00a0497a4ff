"""The command line: options, messages and exit codes only; the work happens elsewhere.

Exit codes: 0 done, 1 a failure while running, 2 a usage mistake, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from pagedcli.errors import PagedCliError, RunError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Local Llama text generation through a paged KV cache you can watch.",
)
err = Console(stderr=True, highlight=False)



@app.callback()
def _group() -> None:
    """Local Llama text generation through a paged KV cache you can watch."""


# --- options shared by every command that runs a model ------------------------------------------
Model = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Model folder, Hub id, `demo`, or `random:llama-3.2-1b`. "
    "Default: Llama-3.2-1B-Instruct if cached, else the built-in demo model.")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Concurrent sequences (slots).")]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV block.")]
NumBlocks = Annotated[Optional[int], typer.Option(help="Physical blocks in the pool (overrides --cache-size).")]
CacheSize = Annotated[Optional[str], typer.Option(help="Pool size, e.g. 2GiB. Default: 2GiB on CUDA, 256MiB on CPU.")]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Longest sequence, prompt included. Default: the model's, "
                                                    "capped by what the pool holds.")]
Eager = Annotated[bool, typer.Option(help="No CUDA graphs (slower; for debugging).")]


def friendly_errors(fn):
    """A user's mistake or a failed run ends with one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PagedCliError as e:
            fail(e)
        except KeyboardInterrupt:
            sys.stdout.flush()
            err.print("\n[yellow]interrupted[/yellow]")
            raise typer.Exit(130)
        except MemoryError:
            fail(RunError("out of memory", "use a smaller --cache-size or --batch"))
        except Exception as e:
            if type(e).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError
                fail(RunError("out of GPU memory", "use a smaller --cache-size or --batch"))
            raise

    return wrapper


def fail(e: PagedCliError):
    err.print(f"[bold red]error:[/bold red] {e.message}" + (f" [dim]({e.hint})[/dim]" if e.hint else ""),
              markup=True, soft_wrap=True)
    raise typer.Exit(e.exit_code)


def notice(text: str) -> None:
    err.print(f"[dim]{text}[/dim]", soft_wrap=True)


def engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager, **extra):
    from pagedcli.loader import EngineOptions

    return EngineOptions(model=model, device=device, dtype=dtype, batch=batch, block_size=block_size,
                         num_blocks=num_blocks, cache_size=cache_size, max_model_len=max_model_len, eager=eager,
                         **extra)


@app.command()
@friendly_errors
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; several run together.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="A UTF-8 file with one prompt per line.")] = None,
    chat: Annotated[Optional[bool], typer.Option(
        "--chat/--raw", help="Wrap prompts in the model's chat template (default when it has one) or feed them as is.")] = None,
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt, at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k likeliest tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set holding this probability (1: off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling (prompt i uses seed + i).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past the model's stop tokens.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per prompt on stdout, nothing else.")] = False,
    live: Annotated[bool, typer.Option("--live", help="Watch the KV cache while it runs (on a terminal only).")] = False,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    batch: Batch = 2,
    block_size: BlockSize = 16,
    num_blocks: NumBlocks = None,
    cache_size: CacheSize = None,
    max_model_len: MaxModelLen = None,
    eager: Eager = False,
):
    """Generate text for one or more prompts, streamed as it comes."""
    from pagedcli import generate as gen
    from pagedcli.loader import load
    from pagedcli.output import JsonPrinter, TextPrinter
    from pagedcli.sequence import SamplingParams

    params = SamplingParams(temperature, top_k, top_p, max_tokens, ignore_eos, seed)
    gen.check_sampling(params)
    texts = gen.read_prompts(prompts or [], prompt_file)
    loaded = load(engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager),
                  notice)
    if loaded.tokenizer is None:
        raise UsageError(f"--model {loaded.source.name} has no tokenizer", "generate needs a model folder with tokenizer.json")
    use_chat = loaded.tokenizer.has_chat_template if chat is None else chat
    if use_chat and not loaded.tokenizer.has_chat_template:
        raise UsageError(f"--chat: model {loaded.source.name} has no chat template", "use --raw")
    engine = loaded.engine
    seqs = gen.add_requests(engine, loaded.tokenizer, texts, params, use_chat)
    failed = [s for s in seqs if s.error]
    for s in failed:
        err.print(f"[bold red]error:[/bold red] prompt {s.id + 1}: {s.error}", soft_wrap=True)
    view = None
    if live:
        from pagedcli.view import open_live_view

        view = open_live_view(engine, loaded.tokenizer.decode, json_output)
        if view is None and not json_output:
            notice("--live: stdout is not a terminal, so no live view")
    out = view.out if view else None
    printer = (JsonPrinter(loaded.tokenizer, seqs, out) if json_output
               else TextPrinter(loaded.tokenizer, seqs, echo_prompt=not use_chat, out=out))
    start = time.perf_counter()
    with view or contextlib.nullcontext():
        gen.run(engine, printer, seqs, on_step=view.on_step if view else None)
    if not json_output:
        notice(gen.summary(seqs, time.perf_counter() - start, engine))
    if failed:
        raise typer.Exit(2)


@app.command("inspect-cache")
@friendly_errors
def inspect_cache(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; several run together.")] = None,
    slot: Annotated[int, typer.Option(help="The slot to show.")] = 0,
    at_step: Annotated[Optional[int], typer.Option(help="Show the cache after this step (1: the first prefill). "
                                                   "Default: the step before the slot's first request finishes.")] = None,
    layer: Annotated[int, typer.Option(help="The layer whose blocks the table shows.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object with every layer's blocks.")] = False,
    prompt_file: Annotated[Optional[Path], typer.Option(help="A UTF-8 file with one prompt per line.")] = None,
    chat: Annotated[Optional[bool], typer.Option(
        "--chat/--raw", help="Wrap prompts in the model's chat template (default when it has one) or feed them as is.")] = None,
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt, at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k likeliest tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set holding this probability (1: off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling (prompt i uses seed + i).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past the model's stop tokens.")] = False,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    batch: Batch = 2,
    block_size: BlockSize = 16,
    num_blocks: NumBlocks = None,
    cache_size: CacheSize = None,
    max_model_len: MaxModelLen = None,
    eager: Eager = False,
):
    """Run the prompts and show one slot's block table, down to byte addresses in the pool."""
    from pagedcli import generate as gen
    from pagedcli import inspect_cache as ic
    from pagedcli.loader import load
    from pagedcli.sequence import SamplingParams

    if not 0 <= slot < max(batch, 1):
        raise UsageError(f"--slot {slot} is out of range",
                         f"--batch {batch} gives " + ("slot 0 only" if batch == 1 else f"slots 0 to {batch - 1}"))
    params = SamplingParams(temperature, top_k, top_p, max_tokens, ignore_eos, seed)
    gen.check_sampling(params)
    texts = gen.read_prompts(prompts or [], prompt_file)
    loaded = load(engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager),
                  notice)
    if loaded.tokenizer is None:
        raise UsageError(f"--model {loaded.source.name} has no tokenizer", "inspect-cache needs a model folder with tokenizer.json")
    num_layers = loaded.engine.cache.geometry.num_layers
    if not 0 <= layer < num_layers:
        raise UsageError(f"--layer {layer} is out of range", f"the model has layers 0-{num_layers - 1}")
    use_chat = loaded.tokenizer.has_chat_template if chat is None else chat
    if use_chat and not loaded.tokenizer.has_chat_template:
        raise UsageError(f"--chat: model {loaded.source.name} has no chat template", "use --raw")
    gen.add_requests(loaded.engine, loaded.tokenizer, texts, params, use_chat)
    snap, view = ic.capture(loaded.engine, slot, at_step)
    decode = functools.partial(loaded.tokenizer.decode, skip_special_tokens=False)
    if json_output:
        print(json.dumps(ic.to_json(snap, view, decode), ensure_ascii=False))
    else:
        Console(highlight=False).print(ic.render(snap, view, decode, layer))


@app.command()
@friendly_errors
def bench(
    batch: Annotated[str, typer.Option("--batch", "-b", help="Slots: one value or a list for a sweep, e.g. 1,8,64,256.")] = "2",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: one per slot).")] = None,
    input_len: Annotated[str, typer.Option(help="Prompt tokens: 128, or a range 100:1024 drawn with --seed.")] = "128",
    output_len: Annotated[str, typer.Option(help="New tokens: 256, or a range.")] = "256",
    seed: Annotated[int, typer.Option(help="Seed for random prompts and lengths.")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly the asked lengths.")] = True,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Real prompts, one per line, instead of random ids.")] = None,
    compare: Annotated[Optional[str], typer.Option(help="`hf`: also time transformers' generate, same model and prompts.")] = None,
    kernel: Annotated[bool, typer.Option("--kernel", help="Time the decode attention kernel alone (CUDA).")] = False,
    bandwidth: Annotated[Optional[float], typer.Option(help="Device bandwidth in GB/s (default: measured once, cached).")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Save tokens/s and step time against batch as PNG.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per batch size on stdout.")] = False,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    block_size: BlockSize = 16,
    num_blocks: NumBlocks = None,
    cache_size: CacheSize = None,
    max_model_len: MaxModelLen = None,
    eager: Eager = False,
):
    """Measure speed, memory and bandwidth against the hardware's roofline."""
    from pagedcli import bench as b
    from pagedcli.bench_view import Progress, results_table
    from pagedcli.loader import load_model

    batches = _int_list(batch, "--batch")
    if compare not in (None, "hf"):
        raise UsageError(f"--compare {compare!r} is not known", "use --compare hf")
    workload = b.Workload(num_prompts, input_len, output_len, seed, ignore_eos, prompt_file)
    b.parse_len(input_len, "--input-len"), b.parse_len(output_len, "--output-len")
    opts = engine_options(model, device, dtype, max(batches), block_size, num_blocks, cache_size, max_model_len, eager)
    loaded = load_model(opts, notice)
    if kernel:
        _kernel_bench(loaded, json_output)
        return
    gbps = bandwidth or b.measure_bandwidth(loaded.device)
    results = []
    with Progress(enabled=not json_output and err.is_terminal, console=err) as progress:
        for n in batches:
            task = progress.task(f"batch {n}")
            results.append(b.run_batch(loaded, opts, n, workload, gbps, progress=task))
            if compare == "hf":
                from pagedcli.bench_hf import hf_generate, hf_model

                requests = b.make_requests(workload, results[-1]["num_prompts"], loaded.source.config.vocab_size,
                                           loaded.source.stop_ids, loaded.tokenizer)
                hf = hf_generate(hf_model(loaded), requests, n, loaded.device, ignore_eos)
                results[-1]["hf_output_tokens_per_s"] = hf["output_tokens_per_s"]
                results[-1]["speedup_vs_hf"] = results[-1]["output_tokens_per_s"] / hf["output_tokens_per_s"]
            if json_output:
                print(json.dumps(results[-1]), flush=True)
    if not json_output:
        Console().print(results_table(results))
    if plot_file is not None:
        b.plot(results, plot_file)
        notice(f"plot saved to {plot_file}")


def _kernel_bench(loaded, json_output: bool) -> None:
    if loaded.device.type != "cuda":
        raise UsageError("--kernel times our CUDA kernel", "run it on a machine with an NVIDIA GPU and CuPy")
    from pagedcli.bench_view import kernel_table
    from pagedcli.kernel_bench import bench_decode_kernel

    c = loaded.source.config
    rows = bench_decode_kernel([1, 8, 64], [512, 4096], head_dim=c.head_dim, num_heads=c.num_heads,
                               num_kv_heads=c.num_kv_heads, dtype=loaded.dtype)
    if json_output:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        Console().print(kernel_table(rows, measure_bandwidth_gbps(loaded.device)))


def measure_bandwidth_gbps(device) -> float:
    from pagedcli.bench import measure_bandwidth

    return measure_bandwidth(device)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a number or a list of numbers", "e.g. 1,8,64") from None
    if not values or min(values) < 1:
        raise UsageError(f"{name} {text!r}: needs numbers of at least 1")
    return values


def main() -> None:
    app()


if __name__ == "__main__":
    main()
