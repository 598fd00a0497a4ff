"""What the commands share at their ends: errors, signals and failed requests turned into one line
each on stderr and an exit code.

Exit codes: 0 done, 1 a failure while running, 2 a usage mistake; ended by a signal, 128 + its
number: 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 129 hung up (SIGHUP), 141 the reader of
stdout went away (a closed pipe).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys

import typer
from rich.console import Console
from rich.markup import escape

from pagedcli.commands.options import with_flags
from pagedcli.core.errors import PagedCliError, RunError, allocation_failure
from pagedcli.core.signals import signals_handled


class Stderr(Console):
    """stderr's console. Once its reader has gone (a closed pipe: a log reader that ended), what is
    written there is lost and the command goes on: rich's own answer is SystemExit(1), which ended a
    server at its next log line, whatever it was serving."""

    def on_broken_pipe(self) -> None:
        self.quiet = True

    def _check_buffer(self) -> None:
        try:
            super()._check_buffer()
        except OSError:  # (its disk full): the line is lost, not written again before the next one
            del self._buffer[:]
            raise


err = Stderr(stderr=True, highlight=False)


def friendly_errors(fn):
    """A user's mistake or a failed run ends with one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            escape_what_stdout_cannot_hold()
            with ending_signals():
                return fn(*args, **kwargs)
        except PagedCliError as e:
            fail(e)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Terminated)
            signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
            with contextlib.suppress(OSError, ValueError):  # (after SIGHUP the terminal may be gone)
                sys.stdout.flush()
                err.print(f"\n[yellow]{ENDED_BY.get(signum, 'interrupted')}[/yellow]")
            raise typer.Exit(128 + signum) from None
        except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeErrors
            if (oom := allocation_failure(e)) is None:
                raise
            fail(oom)
        except OSError as e:
            if e.errno == errno.EPIPE:  # whoever read the output stopped (`| head`): end quietly, as SIGPIPE would
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise typer.Exit(128 + signal.SIGPIPE) from None
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            # the output could not be written: say so once, and let nothing else try to write it
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            fail(RunError(f"writing the output failed: {e.strerror}", "free some space, or write it elsewhere"))

    return wrapper


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that it ends as Ctrl-C ends it (what was
    printed stays, the engine gives its blocks back)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


ENDED_BY = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


@contextlib.contextmanager
def ending_signals():
    """SIGTERM and SIGHUP raise Terminated while a command runs (exit 143 and 129, as 130 for Ctrl-C)."""
    def raise_terminated(signum, _frame):
        raise Terminated(signum)

    with signals_handled((signal.SIGTERM, signal.SIGHUP), raise_terminated):
        yield


def fail(e: PagedCliError):
    hint = f" [dim]({escape(with_flags(e.hint))})[/dim]" if e.hint else ""  # messages may hold [brackets]
    with contextlib.suppress(OSError):  # stderr cannot take the line (its disk full): the exit code still says it
        err.print(f"[bold red]error:[/bold red] {escape(with_flags(e.message))}{hint}", markup=True, soft_wrap=True)
    raise typer.Exit(e.exit_code)


def need_stdout(what: str = "the answers") -> None:
    """Refuse to run, in one line, a command whose output has nowhere to go: standard output closed
    at the start (`>&-`; Python leaves sys.stdout None)."""
    if sys.stdout is None:
        raise RunError(f"standard output is closed, so {what} would go nowhere",
                       "leave it open, or send it to a file or /dev/null")


UNICODE_ENCODINGS = ("utf-8", "utf-8-sig", "utf-16", "utf-32", "gb18030")


def holds_all_text(stream) -> bool:
    """Whether `stream`'s encoding can write every character (else: ascii, latin-1, ...)."""
    import codecs

    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        return codecs.lookup(encoding).name in UNICODE_ENCODINGS
    except LookupError:
        return False


def escape_what_stdout_cannot_hold() -> None:
    """An output encoding that cannot hold every character (PYTHONIOENCODING=ascii, a latin-1
    locale): the characters it cannot hold are written as Python escapes (\\u65e5), as Python
    writes them to stderr, not a UnicodeEncodeError. (--json escapes them as JSON does: output.py.)"""
    stdout = sys.stdout
    if stdout is not None and not holds_all_text(stdout) and hasattr(stdout, "reconfigure"):
        with contextlib.suppress(OSError, ValueError):
            stdout.reconfigure(errors="backslashreplace")


def notice(text: str) -> None:
    """A dim line on stderr; the settings core modules name (`model`) appear as their flags (--model).
    A line stderr cannot take (its disk full) is lost, not the command's work."""
    with contextlib.suppress(OSError):
        err.print(f"[dim]{escape(with_flags(text))}[/dim]", soft_wrap=True)


def report_failures(seqs, samples: int, skip: set[int] | None = None) -> None:
    """One line per failed request. skip None: before the run, where every failure is a refused
    prompt (one line per prompt, for all its answers); else after it, the answers that failed while
    running (those not in `skip`, the refused), one line each."""
    for s in seqs:
        if not s.error or (skip is not None and s.id in skip):
            continue
        prompt, answer = divmod(s.id, samples)
        if skip is None and answer:
            continue  # said once, for its prompt's first answer
        what = f"prompt {prompt + 1}" if skip is None or samples == 1 else f"answer {prompt + 1}.{answer + 1}"
        err.print(f"[bold red]error:[/bold red] {what}: {escape(with_flags(s.error))}", soft_wrap=True)


def exit_for_failures(seqs, refused: set[int]) -> None:
    """Exit 2 when a prompt was refused (a usage mistake), else 1 when a request failed while running."""
    if refused:
        raise typer.Exit(2)
    if any(s.error for s in seqs):
        raise typer.Exit(1)
