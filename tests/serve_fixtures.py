"""What the serve tests (tests/test_serve_*.py) share: `Served`, the real server in this process
(the app `pagedcli serve` builds, on uvicorn in a thread, with its engine in an engine process, as
the command runs it) on a free loopback port with the built-in model; the module-scoped `server`
and `one_slot` fixtures over it (each test module that takes them gets a server of each, shared by
its tests); the prompts they send; and uvicorn's error log as records."""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import ASSETS  # noqa: E402
from helpers import serve_build  # noqa: E402

TEMPLATE = ASSETS / "chat" / "chat_template.jinja"
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING"]


class Served:
    """A server in this process: the app pagedcli serve builds, on uvicorn in a thread, and its
    engine in an engine process, as pagedcli serve starts it."""

    def __init__(self, batch: int = 8, max_waiting: int | None = None, api_key: str | None = None, model: str = "demo",
                 poison: bool = False, template=TEMPLATE, **engine):
        import uvicorn

        from pagedcli.commands.serve import make_server
        from pagedcli.core.options import SamplingParams
        from pagedcli.serve.app import Settings, create_app
        from pagedcli.serve.engine_client import EngineClient
        from pagedcli.serve.metrics import Metrics

        self.api_key = api_key
        self.metrics = Metrics()
        self.engine = EngineClient(serve_build, (model, batch, engine, str(template), poison), self.metrics)
        self.ready = self.engine.start()
        self.settings = settings = Settings(model, SamplingParams(), api_key)  # (read at each request: a test may change it)
        if max_waiting is not None:
            settings.max_waiting = max_waiting
        app = create_app(self.engine, self.ready, settings, self.metrics)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(uvicorn.Config(app, lifespan="off", log_level="warning"), self.engine)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", self.api_key or "none"), max_retries=0,
                             **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until the engine has nothing left (aborts reach it asynchronously), then check,
        in its own snapshot, that every block is back."""
        deadline = time.monotonic() + timeout
        m = self.metrics
        while self.engine.jobs or self.engine.num_waiting or m.running or m.waiting or m.used_blocks:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.01)
        cache = httpx.get(self.url + "/v1/cache", headers={"Authorization": f"Bearer {self.api_key}"}).json()
        assert cache["running"] == [] and cache["waiting"] == []
        assert cache["free_blocks"] == cache["total_blocks"] == self.ready.geometry.num_blocks

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop()


@contextmanager
def served(**opts):
    s = Served(**opts)
    try:
        yield s
    finally:
        s.close()


def server_fixture():
    """The `server` fixture, for a test module to take as `server = server_fixture()`: one server
    with the defaults, shared by the module's tests."""
    @pytest.fixture(scope="module")
    def server():
        with served() as s:
            yield s
    return server


def one_slot_fixture():
    """The `one_slot` fixture, for a test module to take as `one_slot = one_slot_fixture()`."""
    @pytest.fixture(scope="module")
    def one_slot():
        """One running request at a time, one more waiting, and a key: for the tests of what waits."""
        with served(batch=1, max_waiting=1, api_key="sekrit") as s:
            yield s
    return one_slot


@contextmanager
def uvicorn_error_records():
    """The records uvicorn's error log takes while the block runs (past its filters), and the log."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        yield records, log
    finally:
        log.removeHandler(handler)
