"""The garbage collector kept off what a running command holds.

A full collection walks every object the process holds: torch's and the model's, hundreds of
thousands of them, long enough that no step is queued, no frame drawn and no token streamed
meanwhile (docs/performance-log.md, "The host's own work").
Frames of the live view and the server's stream chunks allocate short-lived objects fast enough to
set such collections off. Frozen (moved to the collector's permanent generation, as vLLM's server
and engine do), what is held when the work starts is left out of collections; what is made after
is collected as before."""

import gc
from contextlib import contextmanager

_depth = 0  # frozen_heap()s open in this process: the freeze is the process's, one for all of them


@contextmanager
def frozen_heap(collect: bool = True):
    """The heap frozen while the block runs, and given back after (a process that goes on, a
    test's, collects it again); `collect`: first collect what is garbage already, so that it is
    not kept frozen."""
    global _depth
    if _depth == 0:
        if collect:
            gc.collect()
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
