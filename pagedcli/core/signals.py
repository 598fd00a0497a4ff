"""Signal handlers for the length of a block."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def signals_handled(signums, handler):
    """`handler` for these signals while the block runs, the handlers before it afterwards (one
    that Python did not install comes back as the default)."""
    previous = {}
    try:
        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        pass
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
