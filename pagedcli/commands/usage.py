"""What Click does its own way, brought in line with the rest of the CLI: boolean flags shown as
flags in the help (not as taking a <bool>), and Click's usage errors (no such option, a missing or
bad value, no such command) as one `error:` line with a way out, not a box of five lines."""

from __future__ import annotations

import contextlib
import difflib

from pagedcli.commands.exits import fail
from pagedcli.core.errors import RunError, UsageError

try:  # newer Typer carries its own copy of Click
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

ClickException, ClickUsageError = click_errors.ClickException, click_errors.UsageError
NoSuchOption = click_errors.NoSuchOption
# `pagedcli` alone shows the help (Click raises it as a usage error, exit code 2): left as it is
HELP_ERRORS = tuple(filter(None, [getattr(click_errors, "NoArgsIsHelpError", None)]))

CLOSE = 0.75  # difflib's ratio for a close match, on names without their dashes ("max-token" ~ "max-tokens")


def flags_as_flags(command, *more) -> None:
    """A flag's help shows its name only: Typer's rich help would add <bool>, as if it took a value.
    `more`: options the command does not list (its help option; None where it has none)."""
    for param in [*getattr(command, "params", []), *more]:
        if param is not None and is_option(param) and param.is_flag and param.metavar is None:
            param.metavar = ""


@contextlib.contextmanager
def one_line_usage_errors():
    try:
        yield
    except HELP_ERRORS:
        raise
    except ClickException as e:
        error = UsageError if isinstance(e, ClickUsageError) else RunError
        fail(error(*explain(e)))


def explain(e: ClickException) -> tuple[str, str | None]:
    """Click's message in the CLI's words (lower case, one line) and a hint: for an unknown
    option, the options really close to it, else where the command's options are listed."""
    ctx = getattr(e, "ctx", None)
    message = " ".join(e.format_message().split()).removesuffix(".")
    what = "commands" if "command" in message.lower() else "options"
    listed = f"`{ctx.command_path} --help` lists the {what}" if ctx is not None else None
    if isinstance(e, NoSuchOption):
        close = close_options(e.option_name, ctx)
        hint = f"did you mean {' or '.join(close)}?" if close else listed
        return f"no such option {e.option_name}", hint
    return message[:1].lower() + message[1:], listed


def close_options(name: str, ctx) -> list[str]:
    """The command's options that look like `name`: a close spelling (difflib, without the dashes,
    stricter than Click's guess, which finds "--top-k" close to "--stop"), or names it begins."""
    if ctx is None:
        return []
    options = [opt for p in ctx.command.get_params(ctx) if is_option(p) and not p.hidden
               for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")]
    bare = name.split("=", 1)[0].lstrip("-")
    by_bare = {opt.lstrip("-"): opt for opt in options}
    close = difflib.get_close_matches(bare, by_bare, n=3, cutoff=CLOSE)
    begun = [b for b in by_bare if len(bare) >= 3 and b.startswith(bare) and b not in close]
    return [by_bare[b] for b in close + begun][:3]


def is_option(param) -> bool:
    return param.param_type_name == "option"  # (Typer's options are not Click's Option class in every version)
