"""The command line: the Typer app (app.py) and one module per command, with what they print."""
