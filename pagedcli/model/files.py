"""The one reader for a model folder's files: a file that is there but cannot be read (a folder in
its place, no permission, not UTF-8) ends in one line naming it, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from pagedcli.core.errors import RunError, UsageError
from pagedcli.core.options import MAX_INPUT_FILE_BYTES, MAX_MODEL_FILE_BYTES


class TooLarge(Exception):
    pass


def read_at_most(path: Path | None, limit: int) -> bytes:
    """The file's bytes (standard input's, `path` None), TooLarge past `limit`: a file that never
    ends (/dev/zero, a pipe) is not read until memory runs out."""
    import sys

    if path is None:
        return _read_from(sys.stdin.buffer, limit) if sys.stdin is not None else b""
    with open(path, "rb") as f:
        return _read_from(f, limit)


def _read_from(f, limit: int) -> bytes:
    pieces, size = [], 0
    while piece := f.read(min(1 << 20, limit + 1 - size)):  # (a MiB at a time: no allocation of `limit`)
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            raise TooLarge
    return b"".join(pieces)


def size_text(n: int) -> str:
    return f"{n >> 20:,} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def read_bytes(path: Path) -> bytes:
    path = Path(path)
    try:
        return read_at_most(path, MAX_MODEL_FILE_BYTES)
    except TooLarge:
        raise RunError(f"{path} is larger than {size_text(MAX_MODEL_FILE_BYTES)}, more than any model's file of its kind",
                       "download the model again") from None
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
    try:
        return read_at_most(path, MAX_INPUT_FILE_BYTES).decode("utf-8-sig")
    except TooLarge:
        raise UsageError(f"{what}: larger than {size_text(MAX_INPUT_FILE_BYTES)}, the most a file given here may "
                         "hold") from None
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder", hint) from None
    except PermissionError:
        raise UsageError(f"{what}: cannot be read (permission denied)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what}: not UTF-8 text (byte {e.start})", f"save it as UTF-8; {hint}") from None
