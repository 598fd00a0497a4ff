"""`serve --live`: generate's live view (console/live_view.py) drawn for the server's traffic,
one row per running request named by its client's request id, and the server's log (the access
log: a line per request) printed above the frame.

The view needs the engine, so the engine's process draws it, between steps, as generate draws it
from its step loop, and also while the engine is idle (so log lines still appear). The API
process's log lines travel to it through the pipe (ToView) and wait in the view's held output
until its next frame."""

from __future__ import annotations

import logging

from rich.console import Console

from pagedcli.console.live_view import LiveView


class ServerView(LiveView):
    def __init__(self, engine, console: Console, decode):
        super().__init__(engine, console, decode, hold_output=True)

    def after(self, out) -> None:
        """After each turn of the engine process: `out` the step's output, or None when idle."""
        if out is not None:
            self.on_step(out)
        elif self.clock() - self.last >= self.interval:
            self.refresh()


class ToView:
    """A stream in the API process whose text goes to the engine process, which prints it above
    the live view's frame (written straight to the terminal, it would tear the frame)."""

    def __init__(self, send):
        self.send = send  # EngineClient.log

    def write(self, s: str) -> int:
        self.send(s)
        return len(s)

    def flush(self) -> None:
        pass


def log_above(out: ToView, loggers: tuple[str, ...]) -> None:
    """The loggers' lines go above the frame instead of to the terminal directly."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(out)
