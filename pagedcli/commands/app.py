"""The command line: the Typer app and its commands (one module each: generate.py,
chat.py, inspect_cache.py, bench.py); options, messages and exit codes only, the work happens elsewhere."""

from __future__ import annotations

import typer

from pagedcli.commands import bench, chat, generate, inspect_cache

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Local Llama text generation through a paged KV cache you can watch.",
)


@app.callback()
def _group() -> None:
    """Local Llama text generation through a paged KV cache you can watch."""


app.command()(generate.generate)
app.command()(chat.chat)
app.command("inspect-cache")(inspect_cache.inspect_cache)
app.command()(bench.bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
