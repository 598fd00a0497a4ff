"""`serve --live`: generate's live view (commands/live_view.py) drawn for the server's traffic,
one row per running request named by its client's request id, and the server's log (the access
log: a line per request) printed above the frame.

The view is drawn from the engine thread, between steps, as generate draws it from its step
loop, and also while the engine is idle (so log lines still appear); the log lines are written
from the event loop's thread, hence the lock."""

from __future__ import annotations

import logging
import threading

from rich.console import Console

from pagedcli.commands.live_view import HeldOutput, LiveView


class SharedOutput(HeldOutput):
    """HeldOutput written from one thread (the log) and taken from another (the view)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)

    def take(self, everything: bool = False) -> str:
        with self.lock:
            return super().take(everything)


class ServerView(LiveView):
    def __init__(self, engine, console: Console, decode, out: SharedOutput):
        super().__init__(engine, console, decode, hold_output=True)
        self.out = out

    def after(self, out) -> None:
        """After each turn of the engine thread: `out` the step's output, or None when idle."""
        if out is not None:
            self.on_step(out)
        elif self.clock() - self.last >= self.interval:
            self.refresh()


def log_above(out: SharedOutput, loggers: tuple[str, ...]) -> None:
    """The loggers' lines go above the frame instead of to the terminal directly (which would
    tear it)."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(out)
