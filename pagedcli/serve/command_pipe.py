"""The API process's end of the pipe its commands reach the engine's process by.

A command is written from the event loop at once, and the loop never blocks on it: what the pipe
does not take yet (the engine reads commands only between two steps) waits in a buffer that the
loop writes as the pipe drains (loop.add_writer). A command from another thread (the shutdown's
timer, a log line for the live view) is handed to the loop.

Why not a thread that sends them, as before: with the event loop busy streaming, that thread had to
take the GIL back from it for every send, and a burst of 64 requests reached the engine 20-25 ms
after their routes had submitted them (this project's CPU), every first token that much later.

The engine reads the pipe as a multiprocessing Connection (Connection.recv), so the bytes written
here are that Connection's framing: a 4-byte big-endian length, then the pickle."""

from __future__ import annotations

import asyncio
import os
import select
import struct
import time
from multiprocessing.reduction import ForkingPickler

LONG = 0x7FFFFFFF  # past this, Connection's framing is -1, then an 8-byte length


def frame(obj) -> bytes:
    """`obj` as Connection.send writes it."""
    payload = bytes(ForkingPickler.dumps(obj))
    n = len(payload)
    header = struct.pack("!i", n) if n <= LONG else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + payload


class CommandPipe:
    def __init__(self, writer):
        """writer: the write end of a one-way multiprocessing Pipe (its reader is the engine's)."""
        self.fd = os.dup(writer.fileno())
        writer.close()
        os.set_blocking(self.fd, False)
        self.unsent = bytearray()  # bytes the pipe has not taken yet, in order
        self.loop: asyncio.AbstractEventLoop | None = None  # set at the first request (attach)
        self.closed = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def send(self, command: tuple) -> None:
        """Write `command` (from any thread; from the event loop's, at once)."""
        data = frame(command)
        loop = self.loop
        if loop is None or loop.is_closed():  # no event loop (yet, or any more): a blocking write
            self.write_blocking(data, time.monotonic() + 10.0)
        elif self._in_loop():
            self._write(data)
        else:
            try:
                loop.call_soon_threadsafe(self._write, data)
            except RuntimeError:  # the loop closed meanwhile: stop() sends what matters
                pass

    def _in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _write(self, data: bytes) -> None:
        if self.closed:
            return
        if self.unsent:  # behind earlier bytes: after them
            self.unsent += data
            return
        written = self._write_some(data)
        if written < len(data):
            self.unsent += data[written:]
            self.loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        written = self._write_some(self.unsent)
        del self.unsent[:written]
        if not self.unsent or self.closed:
            self.loop.remove_writer(self.fd)

    def _write_some(self, data) -> int:
        """As much of `data` as the pipe takes now; a pipe the engine has closed takes it all
        (the engine process is gone, which its messages' pipe says)."""
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # EPIPE: the engine process has ended
            self.closed = True
            return len(data)

    def write_blocking(self, data: bytes, deadline: float, while_waiting=lambda: None) -> None:
        """The bytes still unsent, then `data`, waiting for the pipe until `deadline`; between two
        tries, `while_waiting()` (reading the engine's messages: an engine blocked on a send to this
        process reads no command)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_writer(self.fd)
        pending = memoryview(bytes(self.unsent) + data)
        self.unsent.clear()
        while pending and not self.closed and time.monotonic() < deadline:
            if select.select([], [self.fd], [], 0.05)[1]:
                pending = pending[self._write_some(pending):]
            else:
                while_waiting()

    def close(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_writer(self.fd)
        self.closed = True
        os.close(self.fd)
