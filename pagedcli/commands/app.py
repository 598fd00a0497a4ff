"""The command line: the Typer app and its commands (one module each: generate.py,
chat.py, inspect_cache.py, bench.py, serve.py); options, messages and exit codes only, the work happens elsewhere."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from pagedcli import __version__
from pagedcli.commands import bench, chat, generate, inspect_cache, serve
from pagedcli.commands.usage import flags_as_flags, one_line_usage_errors


class Group(TyperGroup):
    """The app's commands with two of Click's ways changed everywhere, whoever adds a command or
    an option: boolean flags shown as flags in the help, and Click's own usage errors (no such
    option, a missing or bad value) as one line, as ours are (commands/usage.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            flags_as_flags(command)
        flags_as_flags(self)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        flags_as_flags(self, option)
        return option

    def make_context(self, *args, **kwargs):
        with one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        for command in self.commands.values():  # a command's help option is made when first asked for
            flags_as_flags(command, command.get_help_option(ctx))
        with one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
    help="Local Llama text generation through a paged KV cache you can watch.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pagedcli {__version__}")
        raise typer.Exit()


@app.callback()
def _group(
    version: Annotated[Optional[bool], typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Local Llama text generation through a paged KV cache you can watch."""


app.command()(generate.generate)
app.command()(chat.chat)
app.command("inspect-cache")(inspect_cache.inspect_cache)
app.command()(bench.bench)
app.command()(serve.serve)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
