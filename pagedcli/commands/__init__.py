"""The command line: the Typer app (app.py) and one module per command, with what they print.

`main` is the `pagedcli` script's entry (and `python -m pagedcli`'s): light, so that a Ctrl-C while
the app's modules are still importing (torch, Typer, rich: the first fraction of a second) ends the
command as a Ctrl-C later does, exit code 130 without a traceback, not by the signal."""

import os

INTERRUPTED = 130  # 128 + SIGINT


def main() -> None:
    import sys

    try:
        keep_standard_streams()
        from pagedcli.commands.app import main as app_main
    except KeyboardInterrupt:
        if sys.stderr is not None:
            sys.stderr.write("\ninterrupted\n")
        sys.exit(INTERRUPTED)
    app_main()


def keep_standard_streams() -> None:
    """A standard stream closed at the start (`>&-`) is /dev/null's from here on, so that no file
    or socket the command opens takes its number and receives what is meant for it (a process the
    server spawns inherits the three). Python left sys.stdout (or the other) None: the commands
    that must write there say so (exits.need_stdout)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # (the lowest free number: the closed one, unless a lower one is closed too)
                os.dup2(null, fd)
                os.close(null)


def _sane_terminal_size() -> None:
    """COLUMNS=0 (or LINES=0) is no size: rich would cut every line it prints to nothing, errors and
    all. Left out, the terminal's own size or 80 columns is used."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit() and int(value) == 0:
            del os.environ[name]


_sane_terminal_size()
