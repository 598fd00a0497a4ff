"""`pagedcli serve` the command, before it serves: what it says in one line when it cannot (FastAPI
or a dependency of uvicorn missing, a port in use or shared by another server's API processes, an
unknown preset, a model the engine process cannot build), the addresses it warns about, and the
package extras that name the server's packages."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import ASSETS  # noqa: E402
from helpers import assert_one_line, invoke  # noqa: E402


def test_serve_without_fastapi_is_one_line_and_the_rest_works():
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from pagedcli.commands.app import app\n"
            "for args in (['serve'], ['generate', '--model', 'demo', '--max-tokens', '3', 'ROMEO:']):\n"
            "    try:\n        app(args)\n    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert lines[:2] == ["error: pagedcli serve needs FastAPI and uvicorn (install them with: pip install "
                         "'pagedcli[serve]')", "exit 1"], out.stderr
    assert lines[-1] == "exit 0" and out.stdout.startswith("ROMEO:"), out.stderr


def test_serve_with_a_dependency_of_uvicorn_missing_names_it(tmp_path):
    """A partial install (uvicorn there, one of its own dependencies not): one line that names the
    missing module and says to install again, not that uvicorn is missing."""
    (tmp_path / "uvicorn").mkdir()
    (tmp_path / "uvicorn" / "__init__.py").write_text("import pagedcli_no_such_dependency\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "from pagedcli.commands.app import app\n"
            "try:\n    app(['serve'])\nexcept SystemExit as e:\n    print('exit', e.code, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: pagedcli serve needs FastAPI and uvicorn, which did not import: No module named "
                     "'pagedcli_no_such_dependency' (install them again with their dependencies: pip install "
                     "--force-reinstall fastapi uvicorn)", "exit 1"], out.stderr


def test_a_port_in_use_is_said_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = invoke("serve", "--port", str(port))
    assert code == 1 and "--port" in err and "cannot listen there" in err and len(err.strip().splitlines()) == 1


def test_an_unknown_random_preset_is_one_line():
    """Not the notice about random weights' missing tokenizer first: the error alone."""
    code, _, err = invoke("serve", "--model", "random:bogus", "--port", "0")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --model random:bogus: no such preset"), err


def test_a_port_another_servers_api_processes_share_is_in_use():
    """--api-server-count binds with SO_REUSEPORT, which would also join another server's sockets
    on the port (another pagedcli serve --api-server-count): the kernel would hand it half their
    connections. The port is in use for it; its own other API processes join it."""
    from pagedcli.commands.serve import bind
    from pagedcli.core.errors import RunError

    other_server = bind("127.0.0.1", 0, share=True)
    port = other_server.getsockname()[1]
    try:
        with pytest.raises(RunError, match="cannot listen there"):
            bind("127.0.0.1", port, share=True)
        ours = bind("127.0.0.1", 0, share=True)
        with ours, bind("127.0.0.1", ours.getsockname()[1], share=True, join=True):
            pass
    finally:
        other_server.close()


def test_a_model_the_engine_process_cannot_build_is_one_line(tmp_path):
    """The engine's process builds the model: its UsageError comes back to be said as generate says it."""
    code, _, err = invoke("serve", "--model", str(tmp_path / "nothing"), "--device", "cpu", "--port", "0")
    assert_one_line(code, err, 2, "--model", "no such folder")


def test_only_loopback_addresses_go_without_a_warning():
    from pagedcli.commands.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("myhost")


def test_the_serve_extra_and_the_test_extra_name_the_servers_packages():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ASSETS.parents[1] / "pyproject.toml").read_text())
    extras = {name: " ".join(packages) for name, packages in project["project"]["optional-dependencies"].items()}
    for name in ("fastapi", "uvicorn", "uvloop", "httptools"):
        assert name in extras["serve"], name
    for name in ("fastapi", "uvicorn", "uvloop", "httptools", "openai", "prometheus_client", "httpx"):
        assert name in extras["test"], name
    assert "pagedcli.serve" in project["tool"]["setuptools"]["packages"]
