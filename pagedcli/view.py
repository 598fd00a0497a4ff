"""The live view of `generate --live`: Rich renderables drawn from a CacheSnapshot, and the `Live`
driver that redraws them while the engine steps.

Two rules keep it from slowing decode: it redraws on a wall-clock budget (every REFRESH_S, not
every step, and from the step loop itself, so no thread competes with the engine), and what it
draws is bounded by the screen, not by the pool: 65,536 blocks are a bar and numbers, a slot
with hundreds of blocks is its first and last cells, and slots beyond the screen are one line.
It reads only the snapshot, plain host-side values, never device tensors.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pagedcli.snapshot import CacheSnapshot, SlotView

REFRESH_S = 0.2  # seconds between frames: five a second reads as live and costs little
MAX_CELLS = 40  # block cells drawn per slot; longer rows show their head and tail
FILL_GLYPHS = " ▁▂▃▄▅▆▇█"  # a cell's height says how full its block is
LINES_AROUND_SLOTS = 14  # lines the frame uses besides the slot rows (panel, pool, waste, table head)


# --- formatting -------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def one_line(text: str) -> str:
    """Answer text inside a table cell: newlines shown, not obeyed."""
    return text.replace("\r", "").replace("\n", "⏎")


def request_label(seq_id: int, prompt: str | None, width: int = 24) -> str:
    """`[3] 'Once upon a…'`: the number the text output labels it with, and its prompt."""
    return f"[{seq_id + 1}] " + (repr(clip(one_line(prompt), width)) if prompt is not None else "(token ids)")


# --- the pieces of a frame ---------------------------------------------------------------------
def block_cells(slot: SlotView, block_size: int, max_cells: int = MAX_CELLS) -> Text:
    """The slot's logical blocks as cells, green when full, yellow and shorter when partial. A row
    too long for the screen keeps its head and tail, with the count of blocks left out between."""
    n = slot.num_blocks
    shown = range(n) if n <= max_cells else [*range(max_cells // 2), *range(n - max_cells // 2 + 1, n)]
    text, previous = Text(), -1
    for logical in shown:
        if logical != previous + 1:
            text.append(f" …{logical - previous - 1:,}… ", style="dim")
        fill = slot.fill(logical, block_size)
        glyph = FILL_GLYPHS[max(1, fill * 8 // block_size)] if fill else "·"  # one token still shows
        text.append(glyph, style="green" if fill == block_size else "yellow" if fill else "dim")
        previous = logical
    return text


def last_block_fill(slot: SlotView, block_size: int) -> str:
    return f"{slot.fill(slot.num_blocks - 1, block_size)}/{block_size}" if slot.num_blocks else "-"


def pool_lines(snap: CacheSnapshot) -> Table:
    """Used, free and total blocks and bytes, with a bar of the used share."""
    geo = snap.geometry
    used, free, total = snap.num_used_blocks, snap.num_free_blocks, geo.num_blocks
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("pool", ProgressBar(total=total, completed=used, width=40, complete_style="magenta"))
    grid.add_row("blocks", f"used {used:,}   free {free:,}   total {total:,}")
    grid.add_row("bytes", f"used {human_bytes(used * geo.block_bytes)}   free {human_bytes(free * geo.block_bytes)}   "
                          f"total {human_bytes(geo.pool_bytes)}   ({human_bytes(geo.block_bytes)} a block of "
                          f"{geo.block_size} tokens, one layer, K then V)")
    return grid


def waste_lines(snap: CacheSnapshot) -> Table:
    """Internal fragmentation of the paged cache (unused token slots in last blocks) against what a
    contiguous cache reserving the maximum length per sequence would leave unused: the comparison
    the PagedAttention paper makes. Counted in tokens of one layer; bytes are over all layers."""
    geo = snap.geometry
    per_token = geo.kv_bytes_per_token  # K and V, every layer
    cached = sum(s.num_cached for s in snap.slots)
    paged = sum(s.num_blocks for s in snap.slots) * geo.block_size
    paged_waste = snap.wasted_token_slots // geo.num_layers
    contiguous = snap.contiguous_token_slots // geo.num_layers
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()

    def line(reserved: int, unused: int, how: str) -> str:
        share = f"{100 * unused / reserved:.1f}%" if reserved else "-"
        return (f"{reserved:,} tokens reserved, {unused:,} unused ({share}) = {human_bytes(unused * per_token)} "
                f"of {human_bytes(reserved * per_token)}   {how}")

    grid.add_row("waste", Text(f"paged       {line(paged, paged_waste, 'unused slots in last blocks')}"))
    grid.add_row("", Text(f"contiguous  {line(contiguous, contiguous - cached, f'max length {snap.max_model_len:,} per sequence')}",
                          style="dim"))
    return grid


def requests_line(snap: CacheSnapshot, max_prompts: int = 3) -> Text:
    text = Text.assemble(("requests", "bold"), f"  running {len(snap.slots)} of {snap.max_slots} slots   "
                         f"waiting {len(snap.waiting)}   finished {snap.num_finished}   ",
                         ("preemptions ", "bold" if snap.num_preemptions else ""),
                         (f"{snap.num_preemptions}", "bold red" if snap.num_preemptions else ""))
    if snap.waiting:
        names = [request_label(w.seq_id, w.prompt, 16) for w in snap.waiting[:max_prompts]]
        more = len(snap.waiting) - max_prompts
        text.append("   next: " + ", ".join(names) + (f", +{more:,} more" if more > 0 else ""), style="dim")
    return text


def slot_table(snap: CacheSnapshot, decode: Callable[[list[int]], str] | None, max_rows: int) -> Table:
    """One row per running slot (as many as fit), then one line for the rest."""
    geo = snap.geometry
    table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    for name, kw in [("slot", {"justify": "right"}), ("request", {}), ("logical blocks", {}),
                     ("last", {"justify": "right"}), ("tokens", {"justify": "right"}),
                     ("blocks held", {"justify": "right"}), ("layer 0 -> physical", {}),
                     ("tok/s", {"justify": "right"}), ("answer so far", {"ratio": 1})]:
        table.add_column(name, no_wrap=True, overflow="ellipsis", **kw)
    shown = snap.slots[:max_rows]
    for s in shown:
        physical = " ".join(map(str, s.table[0][:4])) + (" …" if s.num_blocks > 4 else "") if s.table else ""
        answer = ""
        if decode is not None and s.num_output_tokens:
            answer = one_line(decode(list(s.token_ids[-min(s.num_output_tokens, 48):])))[-80:]
        table.add_row(str(s.slot), request_label(s.seq_id, s.prompt), block_cells(s, geo.block_size),
                      last_block_fill(s, geo.block_size), f"{s.num_cached:,}",
                      f"{s.num_blocks} x {geo.num_layers} = {s.num_blocks * geo.num_layers:,}", physical,
                      f"{s.tokens_per_s:,.0f}", Text(answer, style="cyan"))
    hidden = snap.slots[max_rows:]
    if hidden:
        blocks = sum(s.num_blocks for s in hidden)
        table.add_row("…", f"+{len(hidden):,} more slots", Text(f"{blocks * geo.num_layers:,} blocks", style="dim"))
    if not snap.slots:
        table.add_row("", Text("no running sequences", style="dim"))
    return table


def render(snap: CacheSnapshot, decode: Callable[[list[int]], str] | None = None, max_rows: int = 32,
           tokens_per_s: float | None = None, elapsed: float | None = None) -> Panel:
    """One frame: pool, requests, slots, waste."""
    geo = snap.geometry
    title = f"pagedcli · KV cache · step {snap.step:,}"
    if elapsed is not None:
        title += f" · {elapsed:.1f} s"
    if tokens_per_s is not None:
        title += f" · {tokens_per_s:,.0f} tok/s"
    subtitle = (f"{geo.num_layers} layers x {geo.num_kv_heads} kv heads x {geo.head_dim} dims, "
                f"{str(geo.dtype).removeprefix('torch.')}; every layer owns its own blocks")
    body = Group(pool_lines(snap), requests_line(snap), Text(), slot_table(snap, decode, max_rows), Text(),
                 waste_lines(snap))
    return Panel(body, title=title, title_align="left", subtitle=subtitle, subtitle_align="right")


# --- the driver ---------------------------------------------------------------------------------
class HeldOutput:
    """What the printer writes while the view is on screen. Written straight to the terminal it
    would tear the frame, and printing above the frame redraws it, so whole lines are held here
    and printed above the frame once per refresh."""

    def __init__(self):
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:  # the printer flushes every step; lines leave at the next refresh
        pass

    def take(self, everything: bool = False) -> str:
        cut = len(self.text) if everything else self.text.rfind("\n") + 1
        taken, self.text = self.text[:cut], self.text[cut:]
        return taken


class Frame:
    """What `Live` shows: the latest frame. Rich redraws it also when lines are printed above it,
    so it must always hold the newest frame, not the one of the last explicit refresh."""

    def __init__(self):
        self.current = Text()

    def __rich__(self):
        return self.current


class LiveView:
    """Redraws the frame from a fresh snapshot at most every REFRESH_S, from the step loop
    (`on_step`), and leaves the last frame on screen."""

    def __init__(self, engine, console: Console, decode: Callable[[list[int]], str] | None = None,
                 hold_output: bool = True, clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.console = console
        self.decode = decode
        self.out = HeldOutput() if hold_output else None  # what the printer should write to
        self.clock = clock
        self.frame = Frame()
        self.live = Live(self.frame, console=console, auto_refresh=False, transient=False,
                         redirect_stdout=False, redirect_stderr=False)
        self.start = self.last = 0.0
        self.num_tokens = 0
        self.num_frames = 0

    def __enter__(self) -> "LiveView":
        self.start = self.clock()
        self.live.start()
        self.refresh()
        return self

    def __exit__(self, *exc) -> None:
        self.refresh(everything=True)  # the final frame: every block back in the free list
        self.live.stop()

    def on_step(self, out) -> None:
        self.num_tokens += len(out.tokens)
        if self.clock() - self.last >= REFRESH_S:
            self.refresh()

    def refresh(self, everything: bool = False) -> None:
        self.last = now = self.clock()
        elapsed = now - self.start
        self.frame.current = render(self.engine.snapshot(), self.decode, self.max_rows(),
                                    self.num_tokens / elapsed if elapsed > 0 else None, elapsed)
        lines = self.out.take(everything) if self.out else ""
        if lines:  # printing above the frame redraws it: one draw either way
            self.console.print(lines.removesuffix("\n"), markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            self.live.refresh()
        self.num_frames += 1

    def max_rows(self) -> int:
        return max(1, self.console.height - LINES_AROUND_SLOTS)


def open_live_view(engine, decode: Callable[[list[int]], str] | None, json_output: bool) -> LiveView | None:
    """The view goes where a terminal is: on stdout with the answers' text held and printed above
    it; with --json and stdout piped, on stderr if that is a terminal (stdout stays pure JSON).
    No terminal, no view: output stays plain text, free of escape codes."""
    stdout = Console(file=sys.stdout)
    if stdout.is_terminal:
        return LiveView(engine, stdout, decode, hold_output=True)
    stderr = Console(file=sys.stderr)
    if json_output and stderr.is_terminal:
        return LiveView(engine, stderr, decode, hold_output=False)
    return None
