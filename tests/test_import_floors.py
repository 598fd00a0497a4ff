"""The house keeps its floors: every import inside pagedcli/ goes down (docs/architecture.md, "The
import floors"). Read from the source with ast, nothing imported: a module-level import, one inside a
function and one under `if TYPE_CHECKING` all count, since each ties the packages together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedcli"

# Top to bottom; a package may import those on floors below its own, never one on its floor or above.
FLOORS = (
    ("commands",),  # the command line: Typer, one module per command, what they print
    ("serve", "bench"),  # the OpenAI server over one engine process; the benchmarks
    ("console",),  # what a person sees and types: the cache drawn and as JSON, the live view, prompts
    ("engine",),  # the host side of a step, and the engine's assembly (engine/build.py)
    ("backends",),  # the forward pass's ops: the torch reference and our CUDA kernels
    ("model",),  # what a checkpoint is: config, weights and their formats, tokenizer, network
    ("core",),  # what a step is (the batch, the cache's geometry and device store), the options, errors
)
FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}


def package_of(module: str) -> str | None:
    """pagedcli.<package>.x -> <package>; None for what is not pagedcli's."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pagedcli" and len(parts) > 1 else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join((*base, node.module) if node.module else base)
            else:
                module = node.module
            found.append((node.lineno, module))
            if module == "pagedcli":  # `from pagedcli import x`: x may be a package (or __version__)
                found += [(node.lineno, f"pagedcli.{alias.name}") for alias in node.names
                          if (PACKAGE / alias.name / "__init__.py").is_file()]
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importing package, imported package, where) for every import between two of pagedcli's packages."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            here = {"__init__.py": None, "__main__.py": "commands"}.get(parts[0], "top-level module")
        else:
            here = parts[0]
        for line, module in imports_of(path):
            there = package_of(module)
            if here is not None and there is not None and there != here:
                out.append((here, there, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return out


def test_every_module_lives_in_a_package_of_a_floor():
    """No module beside the packages (a top-level helper would be a floor of its own, unplaced), and
    every package is on a floor."""
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules outside every package: {loose}; put each in the package whose job it is"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(FLOOR), f"packages not on a floor: {packages - set(FLOOR)}; gone: {set(FLOOR) - packages}"


def test_imports_only_go_down():
    """No import goes up or sideways: so no two packages import each other, directly or around a
    loop, and nothing below commands/ imports it."""
    wrong = [f"{where}: {here} imports {there}" for here, there, where in edges()
             if FLOOR[there] <= FLOOR[here]]
    assert not wrong, "imports against the floors (docs/architecture.md):\n" + "\n".join(wrong)


@pytest.mark.parametrize("source, expected", [
    ("from pagedcli.engine.cache import KVCache\n", ("model", "engine")),
    ("def f():\n    from pagedcli.commands import options\n", ("model", "commands")),
    ("from pagedcli import commands\n", ("model", "commands")),
    ("from ..engine import cache\n", ("model", "engine")),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch, source, expected):
    """A check that cannot see an import would pass a house whose floors do not hold: a module-level
    import, one inside a function, `from pagedcli import x` and a relative one are all edges."""
    fake = tmp_path / "pagedcli"
    for package in ("model", "commands"):
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "model" / "bad.py").write_text(source)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    found = {(here, there) for here, there, _ in edges()}
    assert expected in found
    assert FLOOR[expected[1]] <= FLOOR[expected[0]]  # and the floors call it a wrong way
