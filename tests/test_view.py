"""The live view: frames drawn from snapshots, bounded by the screen; the refresh budget; plain output
without a terminal; and the real thing in a real terminal (tmux)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import torch
from rich.console import Console

from helpers import invoke
from pagedcli.core.geometry import CacheGeometry
from pagedcli.engine.snapshot import CacheSnapshot, SlotView, WaitingView
from pagedcli.console.drawing import block_cells, render
from pagedcli.console.live_view import LiveView

from conftest import REPO

PROMPTS = ["Once upon a time", "Tom and his dog", "The sun", "A cat", "Lily", "Ben had a red ball"]
ESCAPE = "\x1b"


def slot_view(slot: int, num_tokens: int, geo: CacheGeometry, first_block: int = 0) -> SlotView:
    n = geo.blocks_for(num_tokens)
    table = tuple(tuple(range(first_block + layer * n, first_block + (layer + 1) * n)) for layer in range(geo.num_layers))
    return SlotView(slot, slot, f"prompt {slot}", 8, tuple(range(num_tokens)), num_tokens, table,
                    num_tokens - 8, 42.0, 0)


def draw(frame, width=120, height=50) -> str:
    console = Console(file=io.StringIO(), width=width, height=height, force_terminal=False)
    console.print(frame)
    return console.file.getvalue()


def test_block_cells_show_fill_and_summarize_long_rows():
    geo = CacheGeometry(16, 4, 8, 5, 1000, torch.float32)
    cells = block_cells(slot_view(0, 37, geo), geo.block_size)  # 16 + 16 + 5
    assert cells.plain == "██▂"
    assert [cells.get_style_at_offset(Console(), i).color.name for i in range(3)] == ["green", "green", "yellow"]
    long = block_cells(slot_view(0, 500 * 16 + 1, geo), geo.block_size, max_cells=20)
    assert long.plain == "█" * 7 + "…486…" + "█" * 7 + "▁"  # head, blocks left out, tail: 20 cells


def test_a_huge_pool_and_256_slots_render_as_a_frame_the_size_of_the_screen():
    geo = CacheGeometry(16, 8, 64, 16, 65536, torch.bfloat16)  # Llama-3.2-1B's 2 GiB pool
    slots = tuple(slot_view(i, 900 + 7 * i, geo) for i in range(256))
    waiting = tuple(WaitingView(256 + i, f"waiting {i}", 30, 0) for i in range(40))
    snap = CacheSnapshot(1234, geo, 1000, slots, waiting, 12, 3, 256, 4096)
    start = time.perf_counter()
    text = draw(render(snap, lambda ids: "story text", max_rows=20, width=160), width=160)
    elapsed = time.perf_counter() - start
    lines = text.splitlines()
    assert len(lines) <= 20 + 14 and all(len(line) <= 160 for line in lines)
    assert "used 64,536   free 1,000   total 65,536" in text and "2.0 GiB" in text
    assert "+236 more running slots" in text and "preemptions 3" in text and "waiting 40" in text
    assert re.search(r"…\d+…", text) and "4/16" in text  # long rows summarized; the real block size
    assert elapsed < 1.0  # generous: it takes milliseconds, not the seconds thousands of cells would


def test_waste_is_shown_against_a_contiguous_max_length_cache():
    geo = CacheGeometry(16, 4, 8, 5, 1000, torch.float32)  # K and V of a token in 5 layers: 1,280 bytes
    snap = CacheSnapshot(7, geo, 975, (slot_view(0, 20, geo), slot_view(1, 40, geo, 10)), (), 0, 0, 2, 512)
    text = draw(render(snap, width=200), width=200)
    # paged: 2 + 3 blocks of 16 hold 60 tokens, 20 slots unused; contiguous: 2 x 512 reserved
    assert "80 tokens reserved, 20 unused (25.0%) = 25.0 KiB" in text
    assert "1,024 tokens reserved, 964 unused (94.1%) = 1.2 MiB" in text


def test_waste_counts_the_blocks_a_chunked_prefill_has_not_written_yet():
    """A prompt of 100 tokens takes its 7 blocks at admission; after a 20-token chunk only 20 slots
    hold K/V, so 92 of its 112 are unused, not the last block's 12 (on the contiguous line's basis)."""
    from dataclasses import replace

    geo = CacheGeometry(16, 4, 8, 5, 1000, torch.float32)
    full = slot_view(0, 100, geo)
    prefilling = replace(full, num_cached=20, prefill_len=100, num_output_tokens=0)
    snap = CacheSnapshot(7, geo, 1000 - 35, (prefilling,), (), 0, 0, 1, 512)
    text = draw(render(snap, width=200), width=200)
    assert "112 tokens reserved, 92 unused (82.1%)" in text
    assert "512 tokens reserved, 492 unused" in text


def test_blocks_shared_by_parallel_samples_are_drawn_blue_and_counted_once(stories, make_engine):
    from pagedcli.core.options import SamplingParams
    from pagedcli.console.drawing import owners_of_blocks

    loaded = make_engine(stories, batch=3, num_blocks=100)
    prompt = loaded.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    loaded.engine.add_parallel(prompt, [SamplingParams(temperature=1.0, max_tokens=20, seed=i) for i in range(3)])
    loaded.engine.step()  # the prefill: all three hold the prompt's blocks
    snap = loaded.engine.snapshot()
    owners = owners_of_blocks(snap)
    assert all(owners[b] == 3 for b in snap.slots[0].table[0])
    cells = block_cells(snap.slots[1], 16, owners=owners)
    assert {span.style for span in cells.spans} == {"blue"}
    held, used = 3 * snap.slots[0].num_blocks * 5, snap.num_used_blocks
    assert used == held // 3  # one copy of each block
    text = draw(render(snap, width=220), width=220)
    assert f"{2 * snap.slots[0].num_blocks * 16} tokens held once for several sequences" in text


def test_live_view_redraws_on_a_wall_clock_budget_and_ends_with_the_pool_free(stories, make_engine):
    from pagedcli.commands import generate as gen
    from pagedcli.commands.output import TextPrinter
    from pagedcli.core.options import SamplingParams

    loaded = make_engine(stories, batch=2, num_blocks=100)
    engine = loaded.engine
    seqs = gen.add_requests(engine, loaded.tokenizer, PROMPTS[:3], SamplingParams(max_tokens=40, ignore_eos=True), False)
    now = [0.0]
    console = Console(file=io.StringIO(), width=160, height=40, force_terminal=True)
    view = LiveView(engine, console, loaded.tokenizer.decode, clock=lambda: now[0])
    printer = TextPrinter(loaded.tokenizer, seqs, echo_prompt=True, out=view.out)

    def on_step(out):
        now[0] += 0.0625  # every step takes 1/16 s of the fake clock: a frame every 4 steps
        view.on_step(out)

    with view:
        gen.stream_answers(engine, printer, seqs, on_step)
    assert view.num_frames == engine.num_steps // 4 + 2  # + the first and the last frame
    final = view.frame.current
    assert "free 100   total 100" in draw(final, width=160)
    output = console.file.getvalue()
    assert "[3] The sun" in output and "Once upon a time, there was" in output  # the answers, above the frame


def generate(*args):
    return invoke("generate", *args)


def test_live_without_a_terminal_is_plain_output(stories):
    args = ("--model", str(stories), "--raw", "--max-tokens", "12", *PROMPTS[:2])
    code, plain, _ = generate(*args)
    code_live, live, stderr = generate("--live", *args)
    assert code == code_live == 0
    assert live == plain and ESCAPE not in live + stderr
    assert "no live view" in stderr
    code, stdout, stderr = generate("--live", "--json", *args)
    assert code == 0 and ESCAPE not in stdout + stderr
    assert [json.loads(line)["prompt"] for line in stdout.splitlines()] == PROMPTS[:2]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_a_real_terminal(stories, tmp_path):
    """Run `generate --live` in a 200 x 50 tmux terminal; watch frames go by; the last one stays."""
    tmux = ["tmux", "-L", f"pagedcli-test-{os.getpid()}-{tmp_path.name}", "-f", "/dev/null"]  # a server of our own
    command = (f"unset COLUMNS LINES; cd {shlex.quote(str(REPO))} && OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} "
               f"-m pagedcli generate --live --model {shlex.quote(str(stories))} --raw --max-tokens 300 --ignore-eos "
               f"--batch 4 --num-blocks 400 {' '.join(map(shlex.quote, PROMPTS))}; echo __EXIT\"\"=$?")
    subprocess.run([*tmux, "new-session", "-d", "-x", "200", "-y", "50"], check=True)
    try:
        subprocess.run([*tmux, "send-keys", command, "Enter"], check=True)
        screens, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True).stdout
            screens.append(screen)
            if "__EXIT=" in screen:
                break
            time.sleep(0.05)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    final = screens[-1]
    assert "__EXIT=0" in final, final
    running = [s for s in screens if re.search(r"running [1-4] of 4 slots", s)]
    assert running, "no frame showed running slots"
    frame = running[len(running) // 2]
    assert re.search(r"blocks +used [1-9][\d,]* +free [\d,]+ +total 400", frame)
    assert re.search(r"│ +\d +\[\d\] '.*' +[█▁▂▃▄▅▆▇]+ +\d+/16", frame), frame  # a slot row: cells, fill
    assert "used 0   free 400   total 400" in final and "finished 6" in final  # the last frame stays
    assert "[6] Ben had a red ball" in final and "tokens/s" in final  # answers above it, summary below


def test_after_ctrl_c_the_frame_counts_what_was_aborted(stories, make_engine):
    """Two requests finished, two cut short and four never run: "finished 2   aborted 6", not
    "finished 8"."""
    from pagedcli.core.options import SamplingParams

    engine = make_engine(stories, batch=2, num_blocks=100).engine
    tokenizer = make_engine(stories, batch=1, num_blocks=20).tokenizer
    short, long = SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=200, ignore_eos=True)
    seqs = [engine.add_request(tokenizer.encode(p), short if i < 2 else long, p) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    while sum(s.is_finished for s in seqs) < 2 or not engine.scheduler.running:
        engine.step()
    engine.abort_all()
    snap = engine.snapshot()
    assert (snap.num_finished, snap.num_aborted, len(snap.waiting), len(snap.slots)) == (2, 6, 0, 0)
    assert "waiting 0   finished 2   aborted 6   preemptions 0" in draw(render(snap))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_ctrl_c_in_the_live_view_leaves_one_true_frame(stories, tmp_path):
    """Ctrl-C in a real terminal while prompts wait: the last frame counts them as aborted, and
    the scrollback holds that one frame, no stray border of an earlier one (nor an echoed ^C)."""
    tmux = ["tmux", "-L", f"pagedcli-test-{tmp_path.name}", "-f", "/dev/null"]
    command = (f"unset COLUMNS LINES; cd {shlex.quote(str(REPO))} && OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} "
               f"-m pagedcli generate --live --model {shlex.quote(str(stories))} --raw --max-tokens 400 --ignore-eos "
               f"--batch 2 --num-blocks 400 {' '.join(map(shlex.quote, PROMPTS))} 2>/dev/null; echo __EXIT\"\"=$?")
    subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40"], check=True)

    def scrollback() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-S", "-"], capture_output=True, text=True).stdout

    try:
        subprocess.run([*tmux, "send-keys", command, "Enter"], check=True)
        deadline = time.monotonic() + 60
        while "running 2 of 2 slots" not in scrollback() and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run([*tmux, "send-keys", "C-c"], check=True)
        while "__EXIT=" not in (screen := scrollback()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    assert "__EXIT=130" in screen, screen
    assert screen.count("╭─ pagedcli") == 1 and screen.count("╰─") == 1, screen
    assert "^C" not in screen
    counts = re.search(r"waiting 0   finished (\d+)   aborted (\d+)", screen)
    assert counts and int(counts[1]) + int(counts[2]) == len(PROMPTS) and int(counts[2]) >= 4, screen


def test_the_heap_stays_frozen_until_the_last_of_nested_freezes_ends():
    """The live view inside a server's engine process both freeze the heap (heap.frozen_heap):
    the freeze is the process's, so the view ending must not give the heap back under the server."""
    import gc

    from pagedcli.core.heap import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap(collect=False):
            pass
        # still frozen (an unfreeze empties the permanent generation; a few of its objects may be
        # freed meanwhile by another test's threads winding down, so not exactly as many)
        assert gc.get_freeze_count() > frozen // 2
    assert gc.get_freeze_count() == 0
