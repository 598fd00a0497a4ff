"""The command line: options, messages and exit codes only; the work happens elsewhere.

Exit codes: 0 done, 1 a failure while running, 2 a usage mistake; ended by a signal, 128 + its
number: 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 129 hung up (SIGHUP), 141 the reader of
stdout went away (a closed pipe).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from pagedcli.errors import PagedCliError, RunError, UsageError, allocation_failure
from pagedcli.model.presets import RANDOM_PRESETS

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
    "--model", "-m", help="Model folder, Hub id, `demo`, or random weights: `random:<preset>` or "
    "`random:<folder with config.json>`. Default: Llama-3.2-1B-Instruct if cached, else the built-in demo model. "
    f"Presets (public checkpoints' shapes): {', '.join(RANDOM_PRESETS)}.")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Concurrent sequences (slots).")]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV block.")]
NumBlocks = Annotated[Optional[int], typer.Option(help="Physical blocks in the pool (overrides --cache-size).")]
CacheSize = Annotated[Optional[str], typer.Option(help="Pool size, e.g. 2GiB. Default: 2GiB on CUDA, 256MiB on CPU.")]
MaxModelLen = Annotated[Optional[int], typer.Option(help="Longest sequence, prompt included. Default: the model's, "
                                                    "capped by what the pool holds.")]
Eager = Annotated[bool, typer.Option(help="No CUDA graphs (slower; for debugging).")]
PrefixCaching = Annotated[bool, typer.Option(help="Reuse the cached blocks of prompt prefixes seen before.")]
Overlap = Annotated[bool, typer.Option(help="On a GPU, queue the next decode step before this one's tokens reach "
                                       "the host, so Python's work per step hides behind the GPU's.")]

# --- prompts and sampling, shared by generate and inspect-cache ----------------------------------
Prompts = Annotated[Optional[list[str]], typer.Argument(help="Prompts; several run together.")]
PromptFile = Annotated[Optional[Path], typer.Option(help="A UTF-8 file with one prompt per line.")]
Chat = Annotated[Optional[bool], typer.Option(
    "--chat/--raw", help="Wrap prompts in the model's chat template (default when it has one) or feed them as is.")]
MaxTokens = Annotated[int, typer.Option(help="New tokens per prompt, at most.")]
Temperature = Annotated[Optional[float], typer.Option(
    help="0 is greedy. Default: the model's generation_config.json when it samples, else 0.", show_default=False)]
TopK = Annotated[Optional[int], typer.Option(help="Sample from the k likeliest tokens (0: off).", show_default=False)]
TopP = Annotated[Optional[float], typer.Option(
    help="Sample from the smallest set holding this probability (1: off).", show_default=False)]
Seed = Annotated[Optional[int], typer.Option(help="Seed for sampling (the i-th answer uses seed + i).")]
IgnoreEos = Annotated[bool, typer.Option(help="Keep going past the model's stop tokens.")]
Samples = Annotated[int, typer.Option("--n", help="Answers per prompt; they share the prompt's blocks "
                                      "(copy-on-write).")]


def friendly_errors(fn):
    """A user's mistake or a failed run ends with one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with ending_signals():
                return fn(*args, **kwargs)
        except PagedCliError as e:
            fail(e)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Terminated)
            signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
            with contextlib.suppress(OSError, ValueError):  # (after SIGHUP the terminal may be gone)
                sys.stdout.flush()
                err.print(f"\n[yellow]{ENDED_BY.get(signum, 'interrupted')}[/yellow]")
            raise typer.Exit(128 + signum) from None
        except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeErrors
            if (oom := allocation_failure(e)) is None:
                raise
            fail(oom)
        except OSError as e:
            if e.errno == errno.EPIPE:  # whoever read the output stopped (`| head`): end quietly, as SIGPIPE would
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise typer.Exit(128 + signal.SIGPIPE) from None
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            # the output could not be written: say so once, and let nothing else try to write it
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            fail(RunError(f"writing the output failed: {e.strerror}", "free some space, or write it elsewhere"))

    return wrapper


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that it ends as Ctrl-C ends it (what was
    printed stays, the engine gives its blocks back)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


ENDED_BY = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


@contextlib.contextmanager
def ending_signals():
    """SIGTERM and SIGHUP raise Terminated while a command runs (exit 143 and 129, as 130 for Ctrl-C)."""
    def raise_terminated(signum, _frame):
        raise Terminated(signum)

    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, raise_terminated)
    except ValueError:  # not the main thread: signals cannot be handled here
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def fail(e: PagedCliError):
    hint = f" [dim]({escape(e.hint)})[/dim]" if e.hint else ""  # messages may hold [brackets]
    err.print(f"[bold red]error:[/bold red] {escape(e.message)}{hint}", markup=True, soft_wrap=True)
    raise typer.Exit(e.exit_code)


def notice(text: str) -> None:
    err.print(f"[dim]{escape(text)}[/dim]", soft_wrap=True)


def engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager,
                   prefix_caching, overlap):
    from pagedcli.model.loader import EngineOptions

    if model is not None and not model.strip():
        raise UsageError("--model is empty", "pass a model folder, a Hub id, or `demo`")
    if max_model_len is not None and max_model_len < 1:
        raise UsageError(f"--max-model-len {max_model_len}: must be at least 1", "leave it out for the model's own")

    return EngineOptions(model=model, device=device, dtype=dtype, batch=batch, block_size=block_size,
                         num_blocks=num_blocks, cache_size=cache_size, max_model_len=max_model_len, eager=eager,
                         prefix_caching=prefix_caching, overlap=overlap)


def start_requests(opts, prompts, prompt_file, chat, sampling: dict, samples, command: str):
    """Everything generate and inspect-cache share: check the input, load the model, queue the
    requests. `sampling` holds the sampling options as given (None: not given). Returns the
    loaded model, the sequences and whether the chat template is used."""
    from pagedcli.commands import generate as gen
    from pagedcli.model.loader import load
    from pagedcli.engine.sequence import SamplingParams

    given = {k for k, v in sampling.items() if v is not None}
    params = SamplingParams(**{k: sampling[k] for k in given})  # the rest: SamplingParams' defaults
    gen.check_sampling(params)
    if samples < 1:
        raise UsageError(f"--n {samples}: needs at least one answer per prompt")
    texts = gen.read_prompts(prompts or [], prompt_file)

    def check(source, tokenizer) -> None:  # before the weights are read
        if tokenizer is None:
            raise UsageError(f"--model {source.name} has no tokenizer", f"{command} needs a model folder with tokenizer.json")
        if chat and not tokenizer.has_chat_template:
            raise UsageError(f"--chat: model {source.name} has no chat template", "use --raw")

    loaded = load(opts, notice, check)
    use_chat = loaded.tokenizer.has_chat_template if chat is None else chat
    params = gen.sampling_defaults(params, loaded.source.generation_config, given,
                                   f"{loaded.source.name}'s generation_config.json")
    seqs = gen.add_requests(loaded.engine, loaded.tokenizer, texts, params, use_chat, samples)
    report_failures(seqs, samples)
    return loaded, seqs, use_chat


def report_failures(seqs, samples: int, skip: set[int] | None = None) -> None:
    """One line per failed request. skip None: before the run, where every failure is a refused
    prompt (one line per prompt, for all its answers); else after it, the answers that failed while
    running (those not in `skip`, the refused), one line each."""
    for s in seqs:
        if not s.error or (skip is not None and s.id in skip):
            continue
        prompt, answer = divmod(s.id, samples)
        if skip is None and answer:
            continue  # said once, for its prompt's first answer
        what = f"prompt {prompt + 1}" if skip is None or samples == 1 else f"answer {prompt + 1}.{answer + 1}"
        err.print(f"[bold red]error:[/bold red] {what}: {escape(s.error)}", soft_wrap=True)


def exit_for_failures(seqs, refused: set[int]) -> None:
    """Exit 2 when a prompt was refused (a usage mistake), else 1 when a request failed while running."""
    if refused:
        raise typer.Exit(2)
    if any(s.error for s in seqs):
        raise typer.Exit(1)


@app.command()
@friendly_errors
def generate(
    prompts: Prompts = None,
    prompt_file: PromptFile = None,
    chat: Chat = None,
    max_tokens: MaxTokens = 256,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    seed: Seed = None,
    ignore_eos: IgnoreEos = False,
    samples: Samples = 1,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per answer on stdout, nothing else.")] = False,
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
    prefix_caching: PrefixCaching = True,
    overlap: Overlap = True,
):
    """Generate text for one or more prompts, streamed as it comes."""
    from pagedcli.commands import generate as gen
    from pagedcli.commands.output import JsonPrinter, TextPrinter

    opts = engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager,
                          prefix_caching, overlap)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, ignore_eos=ignore_eos,
                    seed=seed)
    loaded, seqs, use_chat = start_requests(opts, prompts, prompt_file, chat, sampling, samples, "generate")
    engine = loaded.engine
    view = None
    if live:
        from pagedcli.commands.live_view import open_live_view

        view = open_live_view(engine, loaded.tokenizer.decode, json_output)
        if view is None and not json_output:
            notice("--live: stdout is not a terminal, so no live view")
    out = view.out if view else None
    printer = (JsonPrinter(loaded.tokenizer, seqs, samples, out) if json_output
               else TextPrinter(loaded.tokenizer, seqs, samples, echo_prompt=not use_chat, out=out))
    refused = {s.id for s in seqs if s.error}
    start = time.perf_counter()
    with view or contextlib.nullcontext():
        gen.stream_answers(engine, printer, seqs, on_step=view.on_step if view else None)
    report_failures(seqs, samples, refused)
    if not json_output:
        notice(gen.summary(seqs, time.perf_counter() - start, engine))
    exit_for_failures(seqs, refused)


@app.command("inspect-cache")
@friendly_errors
def inspect_cache(
    prompts: Prompts = None,
    slot: Annotated[int, typer.Option(help="The slot to show.")] = 0,
    at_step: Annotated[Optional[int], typer.Option(help="Show the cache after this step (1: the first prefill). "
                                                   "Default: the step before the slot's first request finishes.")] = None,
    layer: Annotated[int, typer.Option(help="The layer whose blocks the table shows.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object with every layer's blocks.")] = False,
    prompt_file: PromptFile = None,
    chat: Chat = None,
    max_tokens: MaxTokens = 256,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    seed: Seed = None,
    ignore_eos: IgnoreEos = False,
    samples: Samples = 1,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    batch: Batch = 2,
    block_size: BlockSize = 16,
    num_blocks: NumBlocks = None,
    cache_size: CacheSize = None,
    max_model_len: MaxModelLen = None,
    eager: Eager = False,
    prefix_caching: PrefixCaching = True,
):
    """Run the prompts and show one slot's block table, down to byte addresses in the pool."""
    from pagedcli.commands import inspect_cache as ic

    if not 0 <= slot < max(batch, 1):
        raise UsageError(f"--slot {slot} is out of range",
                         f"--batch {batch} gives " + ("slot 0 only" if batch == 1 else f"slots 0 to {batch - 1}"))
    opts = engine_options(model, device, dtype, batch, block_size, num_blocks, cache_size, max_model_len, eager,
                          prefix_caching, overlap=False)  # the cache as each step left it, no step ahead
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, ignore_eos=ignore_eos,
                    seed=seed)
    loaded, seqs, _ = start_requests(opts, prompts, prompt_file, chat, sampling, samples, "inspect-cache")
    num_layers = loaded.engine.cache.geometry.num_layers
    if not 0 <= layer < num_layers:
        raise UsageError(f"--layer {layer} is out of range", f"the model has layers 0-{num_layers - 1}")
    refused = {s.id for s in seqs if s.error}
    snap, view = ic.capture(loaded.engine, slot, at_step)
    report_failures(seqs, samples, refused)
    decode = functools.partial(loaded.tokenizer.decode, skip_special_tokens=False)
    if json_output:
        print(json.dumps(ic.to_json(snap, view, decode), ensure_ascii=False))
    else:
        Console(highlight=False).print(ic.render(snap, view, decode, layer))
    exit_for_failures(seqs, refused)  # shown, but a request failed: as generate does


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
    prefix_len: Annotated[int, typer.Option(help="Make the first P prompt tokens the same in every prompt, and time "
                                            "the first token with and without the prefix cache (hits need more "
                                            "prompts than slots: --num-prompts).")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per batch size on stdout.")] = False,
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    block_size: BlockSize = 16,
    num_blocks: NumBlocks = None,
    cache_size: CacheSize = None,
    max_model_len: MaxModelLen = None,
    eager: Eager = False,
    prefix_caching: PrefixCaching = True,
    overlap: Overlap = True,
):
    """Measure speed, memory and bandwidth against the hardware's roofline."""
    from pagedcli.bench import measure as b
    from pagedcli.commands.bench_view import Progress, results_table
    from pagedcli.model.loader import load_model

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
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        raise UsageError(f"--bandwidth {bandwidth}: must be a positive number of GB/s", "leave it out to measure it")
    if plot_file is not None:
        plot_file = b.plot_path(plot_file)
    workload = b.Workload(num_prompts, input_len, output_len, seed, ignore_eos, prompt_file, prefix_len)
    b.parse_len(input_len, "--input-len"), b.parse_len(output_len, "--output-len")
    opts = engine_options(model, device, dtype, max(batches), block_size, num_blocks, cache_size, max_model_len, eager,
                          prefix_caching, overlap)
    loaded = load_model(opts, notice)
    if kernel:
        _kernel_bench(loaded, json_output, bandwidth)
        return
    gbps = bandwidth or b.measure_bandwidth(loaded.device)
    hf = None
    if compare == "hf":
        from pagedcli.bench.hf import hf_model

        hf = hf_model(loaded)
    results, told = [], set()

    def notice_once(text: str) -> None:  # each batch size builds an engine: say a fallback once
        if text not in told:
            told.add(text)
            notice(text)

    with Progress(enabled=not json_output and err.is_terminal, console=err) as progress:
        for n in batches:
            results.append(b.run_point(loaded, opts, n, workload, gbps, progress.task(f"batch {n}"), hf,
                                       notice_once))
            if json_output:
                print(json.dumps(results[-1]), flush=True)
    if not json_output:
        Console().print(results_table(results))
    if plot_file is not None:
        b.plot(results, plot_file)
        notice(f"plot saved to {plot_file}")


def _kernel_bench(loaded, json_output: bool, bandwidth: float | None) -> None:
    if loaded.device.type != "cuda":
        raise UsageError("--kernel times our CUDA kernel", "run it on a machine with an NVIDIA GPU and CuPy")
    from pagedcli.bench.measure import measure_bandwidth
    from pagedcli.commands.bench_view import kernel_table
    from pagedcli.bench.kernel import bench_decode_kernel

    c = loaded.source.config
    rows = bench_decode_kernel([1, 8, 64], [512, 4096], head_dim=c.head_dim, num_heads=c.num_heads,
                               num_kv_heads=c.num_kv_heads, dtype=loaded.dtype)
    if json_output:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        Console().print(kernel_table(rows, bandwidth or measure_bandwidth(loaded.device)))


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
