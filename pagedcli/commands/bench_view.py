"""How `bench` looks: progress while it runs (a bar on a terminal, plain lines elsewhere), tables
at the end."""

from __future__ import annotations

import time

from rich import box
from rich import progress as rp
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pagedcli.console.drawing import human_bytes

PLAIN_EVERY_S = 10.0  # without a terminal, a progress line at most this often (and one as each batch size ends)


class Progress:
    """Progress per batch size, step by step: tokens generated of those asked for, and the step.
    On a terminal (`console`: stderr) a Rich bar; else plain lines there, so a piped run shows it."""

    def __init__(self, console: Console, clock=time.monotonic):
        self.console = console
        self.clock = clock
        self.bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                               StepsColumn(),
                               rp.TimeElapsedColumn(), rp.TextColumn("eta"), rp.TimeRemainingColumn(),
                               console=console, transient=True) if console.is_terminal else None

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def task(self, description: str, counted: str = "step {:,}"):
        """The callback for one batch size: (tokens done, tokens asked for, count), the count shown
        through `counted` (in-process: the step; against a server: the answers done)."""
        if self.bar:
            task = self.bar.add_task(description, total=None, step=0, counted=counted)
            return lambda done, total, step: self.bar.update(task, completed=done, total=total, step=step)
        start = last = self.clock()
        said = None

        def line(done: int, total: int, step: int) -> None:
            nonlocal last, said
            now = self.clock()
            if (now - last >= PLAIN_EVERY_S or (done == total and step)) and said != (done, total, step):
                last, said = now, (done, total, step)
                self.console.print(f"{description}: {done:,}/{total:,} tokens, {counted.format(step)}, "
                                   f"{now - start:,.0f} s", highlight=False, soft_wrap=True)

        return line


class StepsColumn(rp.ProgressColumn):
    """Tokens generated of those asked for, and the step; before the run knows them, that it starts."""

    def render(self, task) -> Text:
        if task.total is None:
            return Text("building the engine")
        counted = task.fields.get("counted", "step {:,}")
        return Text(f"{task.completed:,.0f}/{task.total:,.0f} tokens, {counted.format(task.fields.get('step', 0))}")


def print_tables(tables: RenderableType, console: Console | None = None) -> None:
    """On a terminal, as wide as the screen; else (a pipe, a file) as wide as the tables want: Rich
    would cut them at 80 columns, which is nobody's screen."""
    console = console or Console()
    if not console.is_terminal:
        wide = Console(width=10_000)
        console = Console(file=console.file, width=max(80, Measurement.get(wide, wide.options, tables).maximum))
    console.print(tables)


def _f(value, fmt="{:,.1f}"):
    return "-" if value is None else fmt.format(value)


def _widest(header: str) -> int:
    return max(len(line) for line in header.split("\n"))


def _bytes(n) -> str:
    return "-" if n is None else human_bytes(n)  # None: not measured (no GPU)


def _arrivals(r: dict) -> str:
    rate = r["request_rate"]
    return "all at the start" if rate is None else f"arriving at {rate:g} a second (Poisson)"


def _chunking(r: dict) -> str:
    if r["chunked_prefill"]:
        return f"chunked prefill, {r['max_num_batched_tokens']:,} tokens a step"
    return f"no chunked prefill (prompts up to {r['max_num_batched_tokens']:,} tokens a step)"


def _precision(r: dict) -> str:
    """`bfloat16`, or `bfloat16, fp8 weights, fp8 KV`, or `bfloat16, weights int4 (group 128, asymmetric)`."""
    weights = r.get("weights")  # the weights' format (Weights.format) where it is not the dtype alone
    fp8 = [what for what, on in (("fp8 weights", r.get("quantization") == "fp8"),
                                 (f"weights {weights}", weights not in (None, r["dtype"]) and r.get("quantization") != "fp8"),
                                 ("fp8 KV", r.get("kv_cache_dtype") == "fp8")) if on]
    ranks = r.get("tensor_parallel_size", 1)
    tp = [f"{ranks} ranks (tensor parallel; bytes are a rank's)"] if ranks > 1 else []
    return ", ".join([r["dtype"]] + fp8 + tp)


def results_table(results: list[dict]) -> Group:
    """Two tables: speed against the roofline, and what the paged cache held."""
    r0 = results[0]
    speed = Table(title=f"{r0['model']} on {r0['device']} ({_precision(r0)})", title_justify="left",
                  caption=f"prompts {r0['input_len']} tokens, {r0['output_len']} new, {_arrivals(r0)}; {_chunking(r0)}; "
                          "roofline: "
                          f"weight + KV bytes a step at {r0['bandwidth_gb_per_s']:,.0f} GB/s",
                  caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ["batch", "tokens/s", "decode\ntok/s", "step\nms", "roofline\nms", "of\nroofline", "GB/s",
                "TTFT\np50 ms", "ITL\np50 ms"]:
        speed.add_column(col, justify="right", min_width=_widest(col))
    sized = ("" if r0["gpu_memory_utilization"] is None
             else f" (the process at {r0['gpu_memory_utilization']:.0%} of the GPU's memory)")
    memory = Table(title=f"KV cache: pool {human_bytes(r0['kv_pool_bytes'])}{sized}", title_justify="left",
                   box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("batch", "blocks peak\n/ total", "KV peak", "contiguous\nwould hold", "saved", "preemptions",
                "GPU memory\npeak"):
        memory.add_column(col, justify="right", min_width=_widest(col))
    for r in results:
        fraction = r["roofline_fraction"]
        row = [str(r["batch"]), _f(r["output_tokens_per_s"], "{:,.0f}"), _f(r["decode_tokens_per_s"], "{:,.0f}"),
               _f(r["decode_step_ms"], "{:.2f}"), _f(r["roofline_step_ms"], "{:.3f}"),
               "-" if fraction is None else f"{100 * fraction:.0f}%", _f(r["achieved_gb_per_s"], "{:,.0f}"),
               _f(r["ttft_ms"]["p50"], "{:.2f}"), _f(r["itl_ms"]["p50"], "{:.3f}")]
        speed.add_row(*row)
        contiguous = r["kv_bytes_contiguous"]
        saved = f"{100 * (1 - r['kv_bytes_peak'] / contiguous):.0f}%" if contiguous else "-"
        memory.add_row(str(r["batch"]), f"{r['kv_blocks_peak']:,}/{r['kv_blocks_total']:,}", _bytes(r["kv_bytes_peak"]),
                       _bytes(contiguous), saved, str(r["preemptions"]), _bytes(r["gpu_memory_peak_bytes"]))
    tables = [speed, memory]
    if any("ttft_ms_without_prefix_cache" in r or r.get("prefix_cache_hit_rate") for r in results):
        prefix = Table(title="prefix cache", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("batch", "hit rate", "TTFT p50 ms", "without cache"):
            prefix.add_column(col, justify="right")
        for r in results:
            without = r.get("ttft_ms_without_prefix_cache") or {}
            prefix.add_row(str(r["batch"]), f"{100 * r['prefix_cache_hit_rate']:.0f}%",
                           _f(r["ttft_ms"]["p50"], "{:.2f}"), _f(without.get("p50"), "{:.2f}"))
        tables.append(prefix)
    if any(r["request_rate"] is not None for r in results):  # requests arriving among decoding ones
        latency = Table(title=f"latency under arrivals, ms; {_chunking(r0)}", title_justify="left",
                        box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("batch", "TTFT mean", "p50", "p99", "ITL mean", "p50", "p99"):
            latency.add_column(col, justify="right")
        for r in results:
            t, i = r["ttft_ms"], r["itl_ms"]
            latency.add_row(str(r["batch"]), *(_f(t[k], "{:.2f}") for k in ("mean", "p50", "p99")),
                            *(_f(i[k], "{:.3f}") for k in ("mean", "p50", "p99")))
        tables.append(latency)
    if any("hf_output_tokens_per_s" in r for r in results):
        hf = Table(title="against transformers' generate, same prompts", title_justify="left",
                   box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("batch", "pagedcli tok/s", "transformers tok/s", "speed-up"):
            hf.add_column(col, justify="right")
        for r in results:
            hf.add_row(str(r["batch"]), _f(r["output_tokens_per_s"], "{:,.0f}"),
                       _f(r.get("hf_output_tokens_per_s"), "{:,.0f}"), _f(r.get("speedup_vs_hf"), "{:.1f}x"))
        tables.append(hf)
    return Group(*tables)


# `bench --kernel`'s rows name the decode kernel that ran (CudaBackend.decode_kernel); the table says which
DECODE_KERNEL_NAMES = {"paged_attention_decode": "split-KV", "paged_attention_decode_cluster": "clusters",
                       "paged_attention_decode_mma": "tensor cores"}


def kernel_table(rows: list[dict], bandwidth_gbps: float) -> Table:
    pool = f", {rows[0]['kv_dtype']} pool" if rows and rows[0].get("kv_dtype", "").startswith("float8") else ""
    t = Table(title=f"decode attention alone{pool}; bandwidth {bandwidth_gbps:,.0f} GB/s", title_justify="left",
              box=box.SIMPLE_HEAD)
    for col in ("batch", "context", "paged\nkernel", "paged\nms", "paged\nGB/s", "of band-\nwidth",
                "SDPA on a\ncontiguous\ncopy, ms", "SDPA\nGB/s", "max |diff|"):
        t.add_column(col, justify="right", min_width=_widest(col))
    for r in rows:
        t.add_row(str(r["batch"]), str(r["context"]), DECODE_KERNEL_NAMES.get(r.get("kernel"), "torch ops"),
                  _f(r["paged_ms"], "{:.4f}"), _f(r["paged_gb_per_s"], "{:,.0f}"),
                  f"{100 * r['paged_gb_per_s'] / bandwidth_gbps:.0f}%", _f(r["sdpa_ms"], "{:.4f}"),
                  _f(r["sdpa_gb_per_s"], "{:,.0f}"), _f(r["max_abs_diff"], "{:.2e}"))
    return t


def quality_table(rows, model: str, dtype: str, device: str, num_tokens: int) -> Table:
    """`bench --quality`: perplexity and greedy agreement of each fp8, int8 and int4 option against the model dtype."""
    table = Table(title=f"{model} on {device}: fp8, int8 and int4 against {dtype}", title_justify="left",
                  caption=f"perplexity on the held-out text; greedy match: the share of the first {num_tokens} greedy "
                          f"tokens equal to {dtype}'s, up to the first difference (mean over the prompts; identical: "
                          "prompts whose tokens all are)",
                  caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("", "KV cache", "weights", "weight bytes", "perplexity", "change", "greedy\nmatch", "identical"):
        table.add_column(col, justify="left" if not col else "right", min_width=_widest(col))
    for i, r in enumerate(rows):
        table.add_row(r.variant, r.dtype if r.kv_cache_dtype == "auto" else r.kv_cache_dtype,
                      r.dtype if r.quantization == "none" else r.quantization, human_bytes(r.weight_bytes),
                      f"{r.perplexity:.3f}", f"{100 * r.perplexity_change:+.2f}%" if i else "-",
                      f"{100 * r.greedy_match:.1f}%", f"{r.identical_prompts}/{r.num_prompts}")
    return table


def served_table(results: list[dict]) -> Table:
    """bench --url: what a client of the server measured, in the in-process table's terms where they
    apply (the roofline and the cache are the server's, out of the client's sight)."""
    r0 = results[0]
    t = Table(title=f"{r0['model']} served at {r0['url']}", title_justify="left",
              caption=f"prompts {r0['input_len']} tokens, {r0['output_len']} new, {_arrivals(r0)}; batch: streams "
                      "open at once; TTFT from each request's arrival, ITL between stream chunks",
              caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("batch", "tokens/s", "requests/s", "TTFT\np50 ms", "TTFT\np99 ms", "ITL\np50 ms", "ITL\np99 ms",
                "errors"):
        t.add_column(col, justify="right", min_width=_widest(col))
    for r in results:
        t.add_row(str(r["batch"]), _f(r["output_tokens_per_s"], "{:,.0f}"), _f(r["requests_per_s"], "{:,.2f}"),
                  _f(r["ttft_ms"]["p50"], "{:.2f}"), _f(r["ttft_ms"]["p99"], "{:.2f}"),
                  _f(r["itl_ms"]["p50"], "{:.3f}"), _f(r["itl_ms"]["p99"], "{:.3f}"),
                  f"{r['errors']:,} of {r['num_prompts']:,}" if r["errors"] else "0")
    return t
