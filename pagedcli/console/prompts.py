"""Where prompts come from: the arguments, a prompt file, or standard input, split on a separator,
and checked to be text a tokenizer can encode."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pagedcli.core.errors import UsageError
from pagedcli.model.files import read_given_text

STDIN = "-"  # a prompt argument or --prompt-file that stands for standard input
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}  # what --prompt-separator reads after a backslash


def stdin_is_terminal() -> bool:
    """Whether a person types at standard input (a function of its own, so tests can fake one)."""
    return sys.stdin is not None and sys.stdin.isatty()


def read_prompts(prompts: list[str], prompt_file: Path | None, separator: str = "\n",
                 command: str = "generate") -> list[str]:
    """Arguments first (standard input's prompts where one is `-`), then the file's (or, for `-`,
    standard input's); with neither and input piped in, standard input's. The text splits at
    `separator` only (a newline: "\n" or "\r\n", not the other breaks str.splitlines knows, such as
    U+2028, U+0085 or a form feed, which a prompt may hold); a byte-order mark at its start is not
    part of its first prompt."""
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        if prompt != STDIN:
            check_text(prompt, f"prompt {i + 1}")
    file_is_stdin = prompt_file is not None and str(prompt_file) == STDIN
    if prompts.count(STDIN) + file_is_stdin > 1:
        raise UsageError("standard input (`-`) is named twice", "it can be read once: name it once")
    implicit = not prompts and prompt_file is None and not stdin_is_terminal()
    if STDIN in prompts:
        i = prompts.index(STDIN)
        found = split_prompts(read_text_from(None, "-: standard input"), separator)
        if not found:
            raise UsageError("-: standard input has no prompts (it is empty)", "pipe prompts in, one a line")
        prompts[i:i + 1] = found
    if prompt_file is not None:
        found = split_prompts(read_text_from(None if file_is_stdin else prompt_file, f"--prompt-file {prompt_file}"),
                              separator)
        if not found:
            what = "standard input" if file_is_stdin else "every line"
            raise UsageError(f"--prompt-file {prompt_file}: has no prompts ({what} is empty)",
                             "write one prompt per line" if separator == "\n" else "check --prompt-separator")
        prompts += found
    elif implicit:
        prompts = split_prompts(read_text_from(None, "standard input"), separator)
        if not prompts:
            raise UsageError("no prompt given, and standard input is empty",
                             f'pass one, e.g. pagedcli {command} "ROMEO:", pipe prompts in, or use --prompt-file')
    if not prompts:
        raise UsageError("no prompt given", f'pass one, e.g. pagedcli {command} "ROMEO:", pipe prompts in, '
                         "or use --prompt-file")
    return prompts


def read_text_from(path: Path | None, what: str) -> str:
    """The UTF-8 text of a prompt file, or of standard input (`path` None); `what` names it in errors."""
    return read_given_text(path, what, "give a text file, one prompt per line")


def prompt_separator(spelling: str) -> str:
    """--prompt-separator as typed, with its backslash escapes read (a newline is awkward to type
    in a shell): '\\n\\n' is a blank line."""
    def escape(match: re.Match) -> str:
        if match.group(1) not in ESCAPES:
            raise UsageError(f"--prompt-separator {spelling!r}: unknown escape \\{match.group(1)}",
                             "use \\n, \\t, \\r or \\\\, e.g. '\\n\\n' for a blank line")
        return ESCAPES[match.group(1)]

    return re.sub(r"\\(.?)", escape, spelling, flags=re.DOTALL)


def split_prompts(text: str, separator: str) -> list[str]:
    """The prompts in `text`: the pieces between separators ("" is none: the whole text is one),
    less the line breaks at their ends; a piece of whitespace only is no prompt."""
    if "\r" not in separator:  # a line may end in "\r\n"
        text = text.replace("\r\n", "\n")
    pieces = text.split(separator) if separator else [text]
    return [piece.strip("\n") for piece in pieces if piece.strip()]


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode: an argument with bytes that are not UTF-8 arrives
    with them as lone surrogates (Python's surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise UsageError(f"{what} is not valid UTF-8 text ({bad} at character {e.start + 1})",
                         "pass UTF-8 text, or put the prompts in a UTF-8 --prompt-file") from None
