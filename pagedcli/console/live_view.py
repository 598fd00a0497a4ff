"""The live view of `generate --live`: the `Live` driver that redraws a frame (drawing.py) of the
cache while the engine steps.

It redraws on a wall-clock budget (every REFRESH_S, stretched when a frame costs more than
MAX_SHARE of the time between frames) and from the step loop itself, so no thread competes with
the engine for the interpreter. It reads only the snapshot (plain host-side values), never device
tensors.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from typing import Callable

try:
    import termios
except ImportError:  # not a POSIX system
    termios = None

from rich.console import Console
from rich.live import Live
from rich.text import Text

from pagedcli.console.drawing import Decode, render
from pagedcli.core.heap import frozen_heap
from pagedcli.core.signals import signals_handled

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
        # frames allocate thousands of short-lived objects: full collections would walk all of the
        # model's and torch's objects between two frames, a visible stall each (heap.py)
        self.frozen = frozen_heap(collect=False)
        self.frozen.__enter__()
        self.keys = no_echoed_control_keys(self.console.file)
        self.keys.__enter__()
        self.start = self.clock()
        self.live.start()
        self.refresh()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.refresh(everything=True)  # the final frame: every block back in the free list
        finally:
            self.live.stop()
            self.keys.__exit__(None, None, None)
            self.frozen.__exit__(None, None, None)

    def on_step(self, out) -> None:
        self.num_tokens += len(out.tokens)
        if self.clock() - self.last >= self.interval:
            self.refresh()

    def refresh(self, everything: bool = False) -> None:
        with signals_after_drawing():
            self._draw(everything)

    def _draw(self, everything: bool) -> None:
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


@contextlib.contextmanager
def no_echoed_control_keys(output):
    """Ctrl-C makes the terminal echo "^C" where the cursor is: after the frame's last line, which
    fills the screen's width, so the cursor wraps onto a new line, the final frame is drawn one line
    too low and the frame's top border stays behind in the scrollback. While the view is on, the
    terminal does not echo control keys (termios ECHOCTL); they still do what they do."""
    tty = next((f for f in (sys.stdin, output) if _is_tty(f)), None)
    if tty is None or termios is None:  # no terminal (tests), or not a POSIX one
        yield
        return
    failed = (OSError, ValueError, termios.error)
    try:
        fd = tty.fileno()
        before = termios.tcgetattr(fd)
        quiet = list(before)
        quiet[3] &= ~termios.ECHOCTL  # [3]: the local modes
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except failed:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(*failed):  # (after SIGHUP the terminal may be gone)
            termios.tcsetattr(fd, termios.TCSANOW, before)


def _is_tty(f) -> bool:
    try:
        return f is not None and f.isatty()
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def signals_after_drawing():
    """A signal in the middle of a draw (Ctrl-C, SIGTERM) would leave half a frame that the next
    draw cannot erase: it waits until the draw is done, then comes as it came."""
    caught: list[int] = []
    try:
        with signals_handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), lambda s, _frame: caught.append(s)):
            yield
    finally:
        if caught:
            signal.raise_signal(caught[0])


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
