"""The API process's end of the pipe its commands reach the engine's process by.

A command is written from the event loop at once, and the loop never blocks on it: what the pipe
does not take yet (the engine reads commands only between two steps) waits in a buffer that the
loop writes as the pipe drains (loop.add_writer). A command from another thread (the shutdown's
timer), or from a signal handler that interrupted a write, is handed to the loop; without a loop
(before the first request, after the server has stopped) it is written at once, waiting for the
pipe.

Why not a thread that sends them, as before: with the event loop busy streaming, that thread had to
take the GIL back from it for every send, so a burst of requests reached the engine well after their
routes had submitted them, every first token that much later
(docs/performance-log.md, "The host's own work").

The engine reads the pipe as a multiprocessing Connection (Connection.recv), so the bytes written
here are that Connection's framing: a 4-byte big-endian length, then the pickle (pickle.dumps:
Connection.send's own pickler copies a dispatch table each call, half the cost of a small command)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pickle
import select
import struct
import threading
import time

LONG = 0x7FFFFFFF  # past this, Connection's framing is -1, then an 8-byte length
WAIT_S = 10.0  # the longest a command written without the event loop waits for the pipe
PIPE_BYTES = 1 << 20  # a pipe's capacity where Linux lets it grow (64 KiB by default)


def frame(obj) -> bytes:
    """`obj` as Connection.send writes it."""
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    header = struct.pack("!i", n) if n <= LONG else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + payload


def widen(fd: int) -> None:
    """Let the pipe hold PIPE_BYTES where the system allows it: the engine's messages then wait in
    the pipe, not in a blocked send, when the API process lags some hundred steps behind."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or over the system's limit: the default stays
        pass


class CommandPipe:
    def __init__(self, writer):
        """writer: the write end of a one-way multiprocessing Pipe (its reader is the engine's)."""
        self.fd = os.dup(writer.fileno())
        writer.close()
        widen(self.fd)
        os.set_blocking(self.fd, False)
        self.unsent = bytearray()  # bytes the pipe has not taken yet, in order
        self.loop: asyncio.AbstractEventLoop | None = None  # set at the first request (attach)
        self.writing = False  # in _write: a signal handler's command then waits for the loop
        self.lock = threading.Lock()  # the writes made without the loop, from any thread
        self.broken = False  # the engine's end has closed (EPIPE): what is sent goes nowhere
        self.closed = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def send(self, command: tuple) -> None:
        """Write `command`, from any thread, and from a signal handler."""
        data = frame(command)
        loop = self.loop
        if loop is None or loop.is_closed():
            self.write_blocking(data, time.monotonic() + WAIT_S)
        elif self._in_loop() and not self.writing:
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
        if self.closed or self.broken:
            return
        self.writing = True
        try:
            if self.unsent:  # behind earlier bytes: after them
                self.unsent += data
                return
            written = self._write_some(data)
            if written < len(data):
                self.unsent += data[written:]
                self.loop.add_writer(self.fd, self._flush)
        finally:
            self.writing = False

    def _flush(self) -> None:
        self.writing = True
        try:
            written = self._write_some(self.unsent)
            del self.unsent[:written]
            if not self.unsent or self.broken:
                self.loop.remove_writer(self.fd)
        finally:
            self.writing = False

    def _write_some(self, data) -> int:
        """As much of `data` as the pipe takes now; a pipe the engine has closed takes it all
        (the engine process is gone, which its messages' pipe says)."""
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # EPIPE: the engine process has ended
            self.broken = True
            return len(data)

    def write_blocking(self, data: bytes, deadline: float, while_waiting=lambda: None) -> None:
        """The bytes still unsent, then `data`, waiting for the pipe until `deadline`; between two
        tries, `while_waiting()` (reading the engine's messages: an engine blocked on a send to this
        process reads no command). Not while the event loop runs. (A signal handler that sends
        while this thread is in here waits for the lock until the deadline, then gives up: the
        command is dropped rather than written into the middle of another.)"""
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return
        try:
            if self.closed or self.broken:
                return
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_writer(self.fd)
            pending = memoryview(bytes(self.unsent) + data)
            self.unsent.clear()
            while pending and not self.broken and time.monotonic() < deadline:
                if select.select([], [self.fd], [], 0.05)[1]:
                    pending = pending[self._write_some(pending):]
                else:
                    while_waiting()
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_writer(self.fd)
            self.closed = True
            os.close(self.fd)
