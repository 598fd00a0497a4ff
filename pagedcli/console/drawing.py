"""A frame of the live view (`generate --live`, live_view.py), drawn from a CacheSnapshot; its
pieces also serve inspect-cache and the bench table.

Two rules keep it from slowing decode (live_view.py has the third, its redraw budget):
- what it draws is bounded by the screen, not by the pool: 65,536 blocks are a bar and numbers,
  a slot of hundreds of blocks is its first and last cells, slots beyond the screen are one line;
- rows are plain styled text laid out here, not a Rich Table, whose layout costs about a
  millisecond a row.
It reads only the snapshot (plain host-side values), never device tensors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rich.console import Group
from rich.panel import Panel
from rich.text import Text

from pagedcli.core.errors import plural

if TYPE_CHECKING:
    from pagedcli.engine.snapshot import CacheSnapshot, SlotView

MAX_CELLS = 48  # width of a slot's block cells, at most; a longer row shows its head and tail
FILL_GLYPHS = " ▁▂▃▄▅▆▇█"  # a cell's height says how full its block is
BAR_WIDTH = 40  # cells of the pool bar
ANSWER_TOKENS = 48  # output tokens decoded for a row's "answer so far"

Decode = Callable[[list[int]], str]


# --- formatting -------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:,.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"


def one_line(text: str) -> str:
    """Text inside a row: newlines shown, not obeyed."""
    return text.replace("\r", "").replace("\n", "⏎")


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def request_label(seq_id: int, prompt: str | None, width: int = 18, request_id: str | None = None) -> str:
    """`[3] 'Once upon a…'`: the number the text output labels the request with, and its prompt;
    a served request: its client's request id."""
    if request_id is not None:
        return clip(one_line(request_id), width + 6)
    return f"[{seq_id + 1}] " + (repr(clip(one_line(prompt), width)) if prompt is not None else "(token ids)")


def line(*parts) -> Text:
    """One line of the frame: too long for the screen, it is cut, not wrapped."""
    return Text.assemble(*parts, no_wrap=True, overflow="ellipsis")


def fit(text: Text | str, width: int, right: bool = False) -> Text:
    """Exactly `width` cells: cut with an ellipsis, or padded."""
    text = Text(text) if isinstance(text, str) else text
    text.truncate(width, overflow="ellipsis")
    text.align("right" if right else "left", width)
    return text


# --- the pieces of a frame ---------------------------------------------------------------------
def owners_of_blocks(snap: CacheSnapshot) -> Counter | None:
    """How many running sequences hold each layer-0 block, or None when none is shared (prefix
    caching and parallel samples share blocks; then the slots hold more blocks than are used)."""
    held = sum(s.num_held for s in snap.slots) * snap.geometry.num_layers
    if held == snap.num_used_blocks:
        return None
    owners = Counter()
    for s in snap.slots:
        owners.update(s.table[0][s.num_released:])
    return owners


def block_cells(slot: SlotView, block_size: int, max_cells: int = MAX_CELLS, owners: Counter | None = None) -> Text:
    """The slot's logical blocks as cells: green when full, yellow and shorter when partial, blue
    when shared with another sequence, a grey × when given back behind a sliding window. A row
    longer than `max_cells` keeps its head and tail, with the count of blocks left out between."""
    n = slot.num_blocks
    keep = max_cells - len(f"…{n:,}…")  # cells drawn when some must be left out
    shown = range(n) if n <= max_cells else [*range(keep // 2), *range(n - (keep - keep // 2), n)]
    runs: list[tuple[str, str]] = []  # (text, style), merged: one span per run, not per cell
    previous, released = -1, slot.num_released
    for logical in shown:
        if logical != previous + 1:
            runs.append((f"…{logical - previous - 1:,}…", "dim"))
        fill = slot.fill(logical, block_size)
        glyph = FILL_GLYPHS[max(1, fill * 8 // block_size)] if fill else "·"  # one token still shows
        if logical < released:
            glyph, style = "×", "grey50"
        elif owners is not None and owners[slot.table[0][logical]] > 1:
            style = "blue"
        else:
            style = "green" if fill == block_size else "yellow" if fill else "dim"
        if runs and runs[-1][1] == style:
            runs[-1] = (runs[-1][0] + glyph, style)
        else:
            runs.append((glyph, style))
        previous = logical
    return Text.assemble(*runs)


def pool_lines(snap: CacheSnapshot) -> list[Text]:
    """Used, free and total blocks and bytes, with a bar of the used share."""
    geo = snap.geometry
    used, free, total = snap.num_used_blocks, snap.num_free_blocks, geo.num_blocks
    filled = round(BAR_WIDTH * used / total)
    return [
        line(("pool      ", "bold"), ("█" * filled, "magenta"), ("░" * (BAR_WIDTH - filled), "grey37"),
             f"  {100 * used / total:.1f}% used"),
        line(("blocks    ", "bold"), f"used {used:,}   free {free:,}   total {total:,}"),
        line(("bytes     ", "bold"),
             f"used {human_bytes(used * geo.block_bytes)}   free {human_bytes(free * geo.block_bytes)}   "
             f"total {human_bytes(geo.pool_bytes)}",
             (f"   {human_bytes(geo.block_bytes)} a block: {plural(geo.block_size, 'token')} of one layer, "
              f"K then V at +{geo.v_offset:#x}", "dim")),
    ]


def waste_lines(snap: CacheSnapshot) -> list[Text]:
    """Internal fragmentation of the paged cache (reserved token slots not written) against what a
    contiguous cache reserving the maximum length for each sequence leaves unused: the comparison
    the PagedAttention paper makes. Tokens are counted in one layer; bytes over all layers.

    Counted over the blocks in use, so a block shared by several sequences counts once. A sequence's
    unwritten slots are its last block's tail and, part-way through a chunked prefill, the blocks
    taken at admission for the chunks still to come; only blocks from the first partial one on can
    hold any (forked sequences may share a partial block until one writes into it)."""
    geo = snap.geometry
    bs = geo.block_size
    paged = snap.num_used_blocks // geo.num_layers * bs
    fill: dict[int, int] = {}  # physical block (layer 0) past a sequence's full ones -> tokens in it
    for s in snap.slots:
        for logical in range(max(s.num_cached // bs, s.num_released), s.num_blocks):
            block = s.table[0][logical]
            fill[block] = max(fill.get(block, 0), s.fill(logical, bs))
    unused = sum(bs - tokens for tokens in fill.values())
    contiguous = snap.contiguous_tokens
    held = sum(s.num_held for s in snap.slots) * bs
    shared = f", {plural(held - paged, 'token')} held once for several sequences" if held > paged else ""

    def waste(label: str, reserved: int, unused: int, how: str, style: str = "") -> Text:
        share = f"{100 * unused / reserved:.1f}%" if reserved else "-"
        return line(("waste     " if label == "paged" else "          ", "bold"), (f"{label:<11}", style),
                    (f"{reserved:,} tokens reserved, {unused:,} unused ({share}) = "
                     f"{human_bytes(unused * geo.kv_bytes_per_token)}", style), (f"   {how}", "dim"))

    return [waste("paged", paged, unused, f"reserved slots not yet written{shared}"),
            waste("contiguous", contiguous, contiguous - sum(s.num_cached for s in snap.slots),
                  f"if each sequence reserved the maximum length, {snap.max_model_len:,} tokens", "dim")]


def requests_line(snap: CacheSnapshot, max_prompts: int = 3) -> Text:
    text = line(("requests  ", "bold"), f"running {len(snap.slots)} of {snap.max_slots} slots   "
                f"waiting {len(snap.waiting)}   finished {snap.num_finished}   ",
                (f"aborted {snap.num_aborted}   ", "bold yellow") if snap.num_aborted else "", "preemptions ",
                (f"{snap.num_preemptions}", "bold red" if snap.num_preemptions else ""))
    if snap.waiting:
        names = [request_label(w.seq_id, w.prompt, 12, w.request_id) for w in snap.waiting[:max_prompts]]
        more = len(snap.waiting) - max_prompts
        text.append("   next: " + ", ".join(names) + (f", +{more:,} more" if more > 0 else ""), style="dim")
    return text


def sharing_line(snap: CacheSnapshot) -> Text:
    return line(("sharing   ", "bold"), f"prefix cache served {100 * snap.prefix_hit_rate:.0f}% of prompt tokens   "
                f"copy-on-write copies {plural(snap.num_copied_blocks, 'block')}")


def window_lines(snap: CacheSnapshot) -> list[Text]:
    """A sliding window's line (Mistral's): what the blocks behind it gave back."""
    if not snap.sliding_window:
        return []
    return [line(("window    ", "bold"), f"sliding window of {plural(snap.sliding_window, 'token')}: "
                 f"{plural(snap.num_window_freed, 'block')} given back behind it so far")]


def rank_lines(snap: CacheSnapshot) -> list[Text]:
    """Tensor parallelism's line: which KV heads of every block each rank holds, and where."""
    if not snap.ranks:
        return []
    return [line(("ranks     ", "bold"), ranks_text(snap))]


def ranks_text(snap: CacheSnapshot) -> str:
    """`2 ranks, each 1 of 2 kv heads of every block, same offsets: rank 0 cpu heads 0 at 0x7f..., ...`"""
    heads = max(r.kv_heads[1] for r in snap.ranks)
    share = snap.ranks[0].kv_heads[1] - snap.ranks[0].kv_heads[0]

    def held(r) -> str:
        first, stop = r.kv_heads
        return f"{first}" if stop - first == 1 else f"{first}-{stop - 1}"

    return (f"{len(snap.ranks)} ranks (tensor parallel), each holding {share} of {heads} kv heads of every block "
            f"at the same offsets in a pool of its own: "
            + ", ".join(f"rank {r.rank} {r.device} head{'s' * (r.kv_heads[1] - r.kv_heads[0] > 1)} {held(r)} "
                        f"at {r.pool_address:#x}" for r in snap.ranks))


@dataclass(frozen=True)
class Column:
    name: str
    width: int | None  # None: takes what is left of the screen
    right: bool = False
    drop: int = 0  # on a narrow screen, columns go in this order (1 first); 0: never


COLUMNS = [Column("slot", 4, True), Column("request", 24), Column("logical blocks", None), Column("last", 5, True),
           Column("tokens", 7, True), Column("blocks held", 16, True, drop=3),
           Column("layer 0 -> physical", 19, drop=1), Column("tok/s", 6, True, drop=4),
           Column("answer so far", None, drop=2)]
GAP = 2  # cells between columns
CELLS_MIN, ANSWER_MIN = 14, 16


def layout(width: int, cells_wanted: int) -> dict[str, int]:
    """The columns that fit in `width` cells, and their widths: the block cells take what they
    want (up to MAX_CELLS), the answer what is left; on a narrow screen columns are dropped."""
    columns = list(COLUMNS)
    while True:
        fixed = sum(c.width or 0 for c in columns) + GAP * (len(columns) - 1)
        answer = ANSWER_MIN if any(c.name == "answer so far" for c in columns) else 0
        cells = max(CELLS_MIN, min(cells_wanted, MAX_CELLS, width - fixed - answer))
        droppable = [c for c in columns if c.drop]
        if width - fixed - cells >= answer or not droppable:
            break
        columns.remove(min(droppable, key=lambda c: c.drop))
    rest = width - fixed - cells
    return {c.name: c.width or (cells if c.name == "logical blocks" else rest) for c in columns}


def slot_rows(snap: CacheSnapshot, decode: Decode | None, max_rows: int, width: int) -> list[Text]:
    """A header, one row per running slot (as many as fit), then one line for the rest."""
    geo = snap.geometry
    widths = layout(width, max((s.num_blocks for s in snap.slots[:max_rows]), default=0))
    shown = [c for c in COLUMNS if c.name in widths]

    def row(values: dict[str, Text | str]) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for c in shown:
            text.append_text(fit(values[c.name], widths[c.name], c.right))
            text.append(" " * GAP)
        text.right_crop(GAP)
        return text

    owners = owners_of_blocks(snap)
    lines = [row({c.name: Text(c.name, style="bold") for c in shown})]
    for s in snap.slots[:max_rows]:
        lines.append(row({
            "slot": str(s.slot),
            "request": request_label(s.seq_id, s.prompt, request_id=s.request_id),
            "logical blocks": block_cells(s, geo.block_size, widths["logical blocks"], owners),
            "last": f"{s.fill(s.num_blocks - 1, geo.block_size)}/{geo.block_size}" if s.num_blocks else "-",
            "tokens": f"{s.num_cached:,}",
            "blocks held": f"{s.num_held:,} x {geo.num_layers} = {s.num_held * geo.num_layers:,}",
            "layer 0 -> physical": (" ".join(map(str, s.table[0][s.num_released:s.num_released + 4]))
                                    + (" …" if s.num_held > 4 else "")),
            "tok/s": f"{s.tokens_per_s:,.0f}",
            "answer so far": (Text(prefill_progress(s), style="yellow") if s.is_prefilling
                              else Text(answer_tail(s, decode, widths.get("answer so far", 0)), style="cyan")),
        }))
    if owners is not None or any(s.num_released for s in snap.slots):
        lines.append(line(("      cells: ", "dim"), ("█", "green"), (" full  ", "dim"), ("▄", "yellow"),
                          (" partial (height: tokens in it)  ", "dim"), ("█", "blue"), (" shared  ", "dim"),
                          ("×", "grey50"), (" given back behind the sliding window", "dim")))
    hidden = snap.slots[max_rows:]
    if hidden:
        blocks = sum(s.num_held for s in hidden) * geo.num_layers
        lines.append(Text(f"   …  +{plural(len(hidden), 'more running slot')} holding {plural(blocks, 'block')}",
                          style="dim"))
    if not snap.slots:
        lines.append(Text("      no running sequences", style="dim"))
    return lines


def prefill_progress(slot: SlotView) -> str:
    """A prompt part-way through its chunked prefill: how much of it is computed."""
    return f"prefill {slot.num_cached:,}/{slot.prefill_len:,}"


def answer_tail(slot: SlotView, decode: Decode | None, width: int) -> str:
    """The newest text of the slot's answer, as much as fits."""
    if decode is None or not slot.num_output_tokens or width <= 0:
        return ""
    text = one_line(decode(list(slot.token_ids[-min(slot.num_output_tokens, ANSWER_TOKENS):])))
    return text if len(text) <= width else "…" + text[-(width - 1):]


def render(snap: CacheSnapshot, decode: Decode | None = None, max_rows: int = 32, width: int = 120,
           tokens_per_s: float | None = None, elapsed: float | None = None) -> Panel:
    """One frame, `width` cells wide: pool, requests, slots, waste."""
    geo = snap.geometry
    title = f"pagedcli · KV cache · step {snap.step:,}"
    if elapsed is not None:
        title += f" · {elapsed:.1f} s"
    if tokens_per_s is not None:
        title += f" · {tokens_per_s:,.0f} tokens/s"
    subtitle = (f"{geo.num_layers} layers x {geo.num_kv_heads} kv heads x {geo.head_dim} dims, "
                f"{geo.kv_dtype_name}; every layer owns its own blocks"
                + (f"; weights {snap.weights}" if snap.weights else ""))
    inner = width - 4  # the panel's border and padding
    body = Group(*pool_lines(snap), *rank_lines(snap), requests_line(snap), sharing_line(snap), *window_lines(snap),
                 Text(),
                 *slot_rows(snap, decode, max_rows, inner), Text(), *waste_lines(snap))
    return Panel(body, title=title, title_align="left", subtitle=subtitle, subtitle_align="right", width=width)
