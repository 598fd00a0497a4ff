"""The live view of `generate --live`: the `Live` driver that redraws a frame (drawing.py) of the
cache while the engine steps.

It redraws on a wall-clock budget (every REFRESH_S, stretched when a frame costs more than
MAX_SHARE of the time between frames) and from the step loop itself, so no thread competes with
the engine for the interpreter. It reads only the snapshot (plain host-side values), never device
tensors.
"""

from __future__ import annotations

import gc
import sys
import time

from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.text import Text

from pagedcli.commands.drawing import Decode, render

REFRESH_S = 0.2  # seconds between frames: five a second reads as live
MAX_SHARE = 0.03  # of the wall time, at most, spent taking snapshots and drawing them
LINES_BESIDE_SLOTS = 14  # lines a frame takes besides the slot rows (borders, pool, sharing, waste, head)


# --- the driver ---------------------------------------------------------------------------------
class HeldOutput:
    """What the printer writes while the view is on screen. Written straight to the terminal it
    would tear the frame, and printing above the frame redraws it, so whole lines wait here and
    are printed above the frame once per refresh."""

    def __init__(self):
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:  # the printer flushes every step; its lines leave at the next refresh
        pass

    def take(self, everything: bool = False) -> str:
        cut = len(self.text) if everything else self.text.rfind("\n") + 1
        taken, self.text = self.text[:cut], self.text[cut:]
        return taken


class Frame:
    """What `Live` shows. Rich redraws it also when lines are printed above it, so it must hold
    the newest frame, not the one of the last explicit refresh."""

    def __init__(self):
        self.current = Text()

    def __rich__(self):
        return self.current


class LiveView:
    """Redraws the frame from a fresh snapshot at most every REFRESH_S, from the step loop
    (`on_step`), and leaves the last frame on screen."""

    def __init__(self, engine, console: Console, decode: Decode | None = None, hold_output: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.console = console
        self.decode = decode
        self.out = HeldOutput() if hold_output else None  # what the printer writes to, if not stdout
        self.clock = clock
        self.frame = Frame()
        self.live = Live(self.frame, console=console, auto_refresh=False, transient=False,
                         redirect_stdout=False, redirect_stderr=False)
        self.start = self.last = 0.0
        self.interval = REFRESH_S
        self.num_tokens = 0
        self.num_frames = 0

    def __enter__(self) -> "LiveView":
        # Frames allocate thousands of short-lived objects, which make Python's garbage collector
        # run its full collections, and a full collection walks every object of the model and of
        # torch: 60-80 ms each, measured. Frozen, those objects are left out of collections.
        gc.freeze()
        self.start = self.clock()
        self.live.start()
        self.refresh()
        return self

    def __exit__(self, *exc) -> None:
        self.refresh(everything=True)  # the final frame: every block back in the free list
        self.live.stop()
        gc.unfreeze()

    def on_step(self, out) -> None:
        self.num_tokens += len(out.tokens)
        if self.clock() - self.last >= self.interval:
            self.refresh()

    def refresh(self, everything: bool = False) -> None:
        begin = self.clock()
        elapsed = begin - self.start
        self.frame.current = render(self.engine.snapshot(), self.decode, self.max_rows(), self.console.width,
                                    self.num_tokens / elapsed if elapsed > 0 else None, elapsed)
        lines = self.out.take(everything) if self.out else ""
        if lines:  # printing above the frame redraws it: one draw either way
            self.console.print(lines.removesuffix("\n"), markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            self.live.refresh()
        self.num_frames += 1
        self.last = self.clock()
        # a frame that cost more than MAX_SHARE of REFRESH_S (a huge batch) spaces out the next one
        self.interval = max(REFRESH_S, (self.last - begin) / MAX_SHARE)

    def max_rows(self) -> int:
        return max(1, self.console.height - LINES_BESIDE_SLOTS)


def open_live_view(engine, decode: Decode | None, json_output: bool) -> LiveView | None:
    """The view goes where a terminal is: on stdout, with the answers' text held and printed above
    it; with --json and stdout piped, on stderr if that is a terminal (stdout stays pure JSON).
    No terminal, no view: the output stays plain text, free of escape codes."""
    stdout = Console(file=sys.stdout)
    if stdout.is_terminal:
        return LiveView(engine, stdout, decode, hold_output=True)
    stderr = Console(file=sys.stderr)
    if json_output and stderr.is_terminal:
        return LiveView(engine, stderr, decode, hold_output=False)
    return None
