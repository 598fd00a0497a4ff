"""The one reader for a model folder's files: a file that is there but cannot be read (a folder in
its place, no permission, not UTF-8) ends in one line naming it, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from pagedcli.core.errors import RunError, UsageError


def read_bytes(path: Path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except IsADirectoryError:
        raise RunError(f"{path} is a folder, not a file", "remove it, or put the file there") from None
    except PermissionError:
        raise RunError(f"{path} cannot be read (permission denied)", "make it readable: chmod a+r") from None
    except OSError as e:
        raise RunError(f"{path} cannot be read ({e.strerror or e})", "download the model again") from None


def read_text(path: Path) -> str:
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunError(f"{path} is not UTF-8 text (byte {e.start})", "download the model again") from None


def read_json(path: Path) -> dict:
    """A model folder's JSON file: {} when it is absent, a one-line error when it is broken."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        value = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise RunError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise RunError(f"{path} holds a JSON {type(value).__name__}, not an object", "a model folder's JSON files "
                       "are objects of settings")
    return value


def read_given_text(path: Path | None, what: str, hint: str) -> str:
    """The UTF-8 text of a file the user named (a prompt file, a chat template), or of standard
    input (`path` None), a byte-order mark dropped. A file that cannot be read is a usage mistake:
    one line that starts with `what` and ends with `hint` where it helps."""
    import sys

    try:
        data = Path(path).read_bytes() if path is not None else sys.stdin.buffer.read() if sys.stdin else b""
        return data.decode("utf-8-sig")
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder", hint) from None
    except PermissionError:
        raise UsageError(f"{what}: cannot be read (permission denied)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what}: not UTF-8 text (byte {e.start})", f"save it as UTF-8; {hint}") from None
