"""The two kinds of failure a user sees: one clear line each, never a traceback.

`UsageError` is a mistake in what the user asked for (exit code 2); `RunError` is something that
went wrong while doing it (exit code 1). Both carry a hint: the way out.

Core code (the engine, the model, the backends) does not know the command line: a message names a
setting the user chose by its field in backticks (`cache_size`, `batch`), and the CLI shows each as
its flag (--cache-size, --batch) through `name_settings`.

`allocation_failure` is the one place that recognizes running out of memory, in any of the forms
torch, numpy and Python report it.
"""

import re


class PagedCliError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and its noun in the right number: "1 token", "2,048 tokens" (`nouns`: an irregular plural)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


SETTING = re.compile(r"`([a-z_]+)`")


def name_settings(text: str, names: dict[str, str]) -> str:
    """`text` with each `field` that `names` knows replaced by its name there (the CLI: its flag)."""
    return SETTING.sub(lambda m: names.get(m.group(1), m.group(0)), text)


class UsageError(PagedCliError):
    exit_code = 2


class RunError(PagedCliError):
    exit_code = 1


# what torch's allocators say when they fail (a plain RuntimeError on the CPU; torch.OutOfMemoryError,
# a RuntimeError too, on a GPU)
_ALLOCATION_TEXT = re.compile(r"can't allocate|cannot allocate|out of memory|failed to allocate", re.IGNORECASE)
OUT_OF_MEMORY_HINT = "use a smaller --cache-size, --batch or prompt"


def is_allocation_failure(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and bool(_ALLOCATION_TEXT.search(str(e))))


def allocation_failure(e: BaseException, what: str | None = None, hint: str = OUT_OF_MEMORY_HINT) -> RunError | None:
    """The one-line RunError for a failed allocation (None when `e` is something else): "`what`
    does not fit in memory", or "out of memory" with torch's figure of what it asked for, if it
    gives one."""
    if not is_allocation_failure(e):
        return None
    where = "GPU memory" if "cuda" in str(e).lower() or type(e).__name__ == "OutOfMemoryError" else "cpu memory"
    asked = re.search(r"tried to allocate ([\d.]+ ?[KMGT]i?B|\d+ bytes)", str(e), re.IGNORECASE)
    detail = f" (it asked for {asked.group(1)})" if asked else ""
    return RunError(f"{what} does not fit in {where}" if what else f"out of {where}{detail}", hint)


def show_value(value) -> str:
    """A value from a user's file as an error message quotes it: its repr, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
