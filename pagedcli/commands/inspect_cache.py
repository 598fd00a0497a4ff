"""`pagedcli inspect-cache`: one slot's block table at one moment, down to byte addresses in the pool.

The moment is a snapshot taken after an engine step. By default it is the last one in which the
first request to occupy the slot is still there (the step before it finishes, when its table is
longest); `--at-step N` takes the snapshot after step N, whoever occupies the slot then (under
continuous batching a slot is reused by later requests).

A physical block b of the pool starts at byte b x block_bytes: K for block_size tokens, then V at
v_offset. Every layer owns its own blocks, so the same tokens sit in a different block per layer.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pagedcli.commands.exits import exit_for_failures, friendly_errors, report_failures
from pagedcli.commands.generate import start_requests
from pagedcli.commands.options import EngineFlags, RequestFlags, flag_group
from pagedcli.console.cache_json import block_texts, block_token_ids, shared_with, to_json
from pagedcli.console.drawing import human_bytes, prefill_progress, ranks_text, request_label
from pagedcli.core.errors import UsageError, plural
from pagedcli.core.json_lines import one_line

if TYPE_CHECKING:  # the engine and torch load once the command runs, not for --help
    from pagedcli.engine.engine import Engine
    from pagedcli.engine.snapshot import CacheSnapshot, SlotView


# --- finding the moment ---------------------------------------------------------------------------
def capture(engine: Engine, slot: int, at_step: int | None = None) -> tuple[CacheSnapshot, SlotView]:
    """Step the engine (its requests already added) to the moment to show; returns that snapshot
    and the slot's view in it. Stops stepping as soon as the moment is known."""
    if at_step is not None:
        return _at_step(engine, slot, at_step)
    first, last = None, None  # the slot's first request, and the last snapshot holding it
    while engine.has_unfinished:
        out = engine.step()
        if out.idle:
            break
        if first is None:
            first = next((s for s in out.seqs + out.prefilling if s.slot == slot), None)
        if first is None:
            continue
        if first.is_finished:
            break
        if first.slot == slot:  # still there (a preempted request leaves its slot)
            last = engine.snapshot()
    if last is None and first is None:
        n = len(engine.sequences)
        raise UsageError(f"--slot {slot}: no request ran in it ({plural(n, 'request')} for slots from 0)",
                         f"run at least {plural(slot + 1, 'prompt')}, or choose a lower --slot")
    if last is None:
        raise UsageError(f"--slot {slot}: its request finished in the step that started it, so no step left it in "
                         "the cache", "use --max-tokens 2 or more, or --at-step 1")
    return last, last.slot(slot)


def _at_step(engine: Engine, slot: int, at_step: int) -> tuple[CacheSnapshot, SlotView]:
    if at_step < 1:
        raise UsageError(f"--at-step {at_step}: must be 1 or more", "step 1 is the first prefill")
    # A step past the bound is refused before anything runs; within it the run goes on, and if it
    # ends sooner (batch mates decode together, stop tokens) the refusal names its real last step.
    # (The bound tightens as the run goes: asked again mid-run it would name another step each time.)
    last = last_step_at_most(engine)
    if last is not None and last < at_step:
        raise UsageError(f"--at-step {at_step}: the run ends by step {last:,} at the latest",
                         "choose an earlier step (it may end sooner: stop tokens, batch mates decoding "
                         "together), or ask for more --max-tokens")
    while engine.num_steps < at_step and engine.has_unfinished:
        if engine.step().idle:
            break
    if engine.num_steps < at_step:
        raise UsageError(f"--at-step {at_step}: the run ended after step {engine.num_steps:,}",
                         f"choose a step from 1 to {engine.num_steps:,}")
    snap = engine.snapshot()
    view = snap.slot(slot)
    if view is None:
        raise UsageError(f"--slot {slot} is empty after step {at_step}", "choose another step or slot")
    return snap, view


def last_step_at_most(engine: Engine) -> int | None:
    """The last step the run can reach, at most, or None when preemption could add steps. Every
    step feeds at least one token that is still to be fed: a prefill at least one prompt token
    (chunked or not), a decode one token of each running request. A request still has to feed the
    tokens not in the cache (a decoding one: its last token), and one more for each new token after
    the next, so what is left takes no more steps than those add up to, unless a preempted request
    must feed its tokens again, which cannot happen when the pool holds every unfinished request at
    its longest at once."""
    cache, geo = engine.cache, engine.cache.geometry
    steps = blocks = 0
    for seq in engine.sequences:
        if seq.is_finished:
            continue
        left = seq.params.max_tokens - len(seq.output_token_ids)  # new tokens still to come, at most
        steps += len(seq.token_ids) - seq.num_cached + left - 1
        longest = min(len(seq.prompt_token_ids) + seq.params.max_tokens, cache.max_model_len)
        blocks += geo.blocks_for(longest) * geo.num_layers
    return engine.num_steps + steps if blocks <= geo.num_blocks else None


def ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def other_layers_note(view: SlotView, layer: int) -> str:
    """How the other layers map the same logical blocks (every layer owns its own blocks)."""
    others = [other for other in range(len(view.table)) if other != layer]
    if not others:
        return "the model has one layer"
    differ = [other for other in others if view.table[other] != view.table[layer]]
    same = [other for other in others if other not in differ]
    note = []
    if differ:
        example = differ[0]
        held = view.table[example][view.num_released:]
        gone = f"{view.num_released} given back, then " if view.num_released else ""
        note.append(f"layer{'s' * (len(differ) > 1)} {ranges(differ)} hold the same tokens in other physical blocks "
                    f"(layer {example}: {gone}{' '.join(map(str, held[:6]))}{' …' if len(held) > 6 else ''})")
    if same:
        note.append(f"layer{'s' * (len(same) > 1)} {ranges(same)} map to the same physical blocks")
    return "; ".join(note)


# --- the two outputs ----------------------------------------------------------------------------
def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def render(snap: CacheSnapshot, view: SlotView, decode, layer: int = 0, other_layers: str = "--layer picks another") -> Group:
    """The slot's request, the pool's geometry, and a table of one layer's blocks (`other_layers`:
    how to see the others, or None)."""
    geo = snap.geometry
    token_blocks = block_token_ids(view, geo.block_size)
    texts = block_texts(decode, token_blocks)
    digits = len(f"{geo.pool_bytes:x}")
    num_output = len(view.token_ids) - view.num_prompt_tokens

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("slot", f"{view.slot} after step {snap.step:,}: request {request_label(view.seq_id, view.prompt, 40)}")
    head.add_row("tokens", f"{len(view.token_ids):,} ({view.num_prompt_tokens:,} prompt + {num_output:,} output), "
                           f"{view.num_cached:,} in the cache, in {plural(view.num_blocks, 'block')} a layer")
    if snap.sliding_window:
        head.add_row("window", f"sliding window of {snap.sliding_window:,} tokens: "
                               f"{plural(view.num_released, 'block')} a layer given back behind it, "
                               f"{view.num_held:,} held; {plural(snap.num_window_freed, 'block')} given back in all")
    if view.is_prefilling:
        head.add_row("prefill", Text(f"part-way: {prefill_progress(view)} tokens computed; chunked prefill computes "
                                     "the rest in later steps, into the blocks it holds", style="yellow"))
    head.add_row("geometry", f"{plural(geo.block_size, 'token')} a block x {geo.num_kv_heads} kv heads x "
                             f"{geo.head_dim} dims, "
                             f"{geo.kv_dtype_name}: {geo.block_bytes:,} bytes a block, "
                             f"K at +0x0, V at +{geo.v_offset:#x}")
    if snap.weights:
        head.add_row("weights", snap.weights)
    if snap.ranks:
        head.add_row("ranks", ranks_text(snap))
    head.add_row("pool", f"{geo.num_blocks:,} blocks = {geo.pool_bytes:,} bytes ({human_bytes(geo.pool_bytes)}); "
                         f"{snap.num_free_blocks:,} free, {snap.num_used_blocks:,} used")
    head.add_row(f"layer {layer}", Text(other_layers_note(view, layer) + (f"; {other_layers}" if other_layers else ""),
                                             style="dim"))

    shared = shared_with(snap, view)[layer]
    table = Table(header_style="bold", title_justify="left")
    columns = ["logical", "physical", "tokens", "fill", "K address", "V address"] + (["shared with"] if shared else [])
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("text", overflow="fold")
    for i, physical in enumerate(view.table[layer]):
        first = i * geo.block_size
        fill = len(token_blocks[i])
        if physical < 0:  # given back: every later token attends past it (the sliding window)
            cells = [str(i), Text("-", style="grey50"), f"{first}-{first + fill - 1}",
                     Text("given back", style="grey50"), "-", "-"] + ([""] if shared else [])
            table.add_row(*cells, Text(escape(texts[i]), style="grey50"))
            continue
        k = physical * geo.block_bytes
        cells = [str(i), str(physical), f"{first}-{first + fill - 1}" if fill else "-",
                 Text(f"{fill}/{geo.block_size}", style="green" if fill == geo.block_size else "yellow"),
                 f"0x{k:0{digits}x}", f"0x{k + geo.v_offset:0{digits}x}"]
        if shared:
            cells.append(Text(", ".join(f"slot {s}" for s in shared.get(physical, [])), style="blue"))
        table.add_row(*cells, Text(escape(texts[i]), style="cyan"))
    return Group(head, table)


@friendly_errors
@flag_group(RequestFlags, "requests", first=True)
@flag_group(EngineFlags, "engine_flags", leave_out={"overlap": False})  # the cache as each step left it
def inspect_cache(
    slot: Annotated[int, typer.Option(help="The slot to show.")] = 0,
    at_step: Annotated[Optional[int], typer.Option(help="Show the cache after this step (1: the first prefill). "
                                                   "Default: the step before the slot's first request finishes.")] = None,
    layer: Annotated[int, typer.Option(help="The layer whose blocks the table shows.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object with every layer's blocks.")] = False,
    *, requests: RequestFlags, engine_flags: EngineFlags,
):
    """Run the prompts and show one slot's block table, down to byte addresses in the pool."""
    batch, samples = engine_flags.batch, requests.samples
    if not 0 <= slot < max(batch, 1):
        raise UsageError(f"--slot {slot} is out of range",
                         f"--batch {batch} gives " + ("slot 0 only" if batch == 1 else f"slots 0 to {batch - 1}"))
    loaded, seqs, _ = start_requests(engine_flags, requests, "inspect-cache")
    num_layers = loaded.engine.cache.geometry.num_layers
    if not 0 <= layer < num_layers:
        raise UsageError(f"--layer {layer} is out of range", f"the model has layers 0-{num_layers - 1}")
    refused = {s.id for s in seqs if s.error}
    snap, view = capture(loaded.engine, slot, at_step)
    report_failures(seqs, samples, refused)
    decode = functools.partial(loaded.tokenizer.decode, skip_special_tokens=False)
    if json_output:
        print(one_line(json.dumps(to_json(snap, view, decode), ensure_ascii=False)))
    else:
        Console(highlight=False).print(render(snap, view, decode, layer))
    exit_for_failures(seqs, refused)  # shown, but a request failed: as generate does
