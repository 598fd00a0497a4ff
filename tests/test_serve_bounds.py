"""The server's bounds (issue 51): a request body past --max-request-size is a 413 before it is
read, counts and hopeless lengths are refused before anything is tokenized, stop strings have their
limits, and a hung engine (SIGSTOP) is a 503 on /health and for new requests, its open requests
ended, until it answers again. The real server on a loopback port; waits are bounded and generous,
nothing is timed. (tools/soak_bounds.py measures what these bound: a neighbour's inter-token gap
under a stop-string flood, the API process's memory after a large body, the time to a 503.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_fixtures import served, server_fixture  # noqa: E402

from pagedcli.core.options import MAX_STOP_STRINGS  # noqa: E402

server = server_fixture()


def counting_encodes(server, monkeypatch) -> list[int]:
    """The API process's tokenizer, counting the characters it is given."""
    tokenizer = server.ready.tokenizer
    encode, encode_rendered, seen = tokenizer.encode, tokenizer.encode_rendered, []

    def counted(text, *args, **kw):
        seen.append(len(text))
        return encode(text, *args, **kw)

    def counted_rendered(text, *args, **kw):
        seen.append(len(text))
        return encode_rendered(text, *args, **kw)

    monkeypatch.setattr(tokenizer, "encode", counted)
    monkeypatch.setattr(tokenizer, "encode_rendered", counted_rendered)
    return seen


# --- bodies -------------------------------------------------------------------------------------
def test_a_body_past_the_limit_is_a_413_said_or_streamed(server, monkeypatch):
    """A 50 MB prompt took the API process from 261 MB to 6 GB before its 400. Now a body larger
    than --max-request-size is a 413: by its Content-Length before it is read, or, sent in chunks
    without one, as soon as what came passes the limit."""
    monkeypatch.setattr(server.settings, "max_body_bytes", 20_000)
    body = b'{"prompt": "' + b"a" * 30_000 + b'", "max_tokens": 2}'
    said = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=60)
    assert said.status_code == 413 and said.json()["error"]["code"] == "request_too_large"
    assert "(29.33 KiB) is larger than the 19.53 KiB this server takes" in said.json()["error"]["message"]

    def chunks():
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    streamed = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    assert streamed.status_code == 413 and "--max-request-size" in streamed.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server, and the limit for what fits, go on


def test_more_prompts_than_the_server_takes_are_refused_before_one_is_tokenized(server, monkeypatch):
    """A body of 2,000,000 short prompts was tokenized whole (25-55 s) before its count was refused."""
    seen = counting_encodes(server, monkeypatch)
    room = server.ready.max_slots + server.settings.max_waiting
    for prompt in (["hi"] * (room + 1), [[1, 2]] * (room + 1)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert f"asks for {room + 1:,} answers" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["hi"] * 40, "n": 128, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "asks for 5,120 answers" in r.json()["error"]["message"]
    assert seen == []


def test_a_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(server, monkeypatch):
    """No token of the demo model's stands for more than 17 characters: a text of more than 512 x 17
    cannot fit its 512 tokens, and tokenizing it would take some hundred times its size."""
    seen = counting_encodes(server, monkeypatch)
    long = "hello " * 2_000  # 12,000 characters
    r = httpx.post(server.url + "/v1/completions", json={"prompt": long, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "`prompt`: 12,000 characters" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": long}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert seen == []
    fits = httpx.post(server.url + "/v1/completions", json={"prompt": "hello " * 50, "max_tokens": 2}, timeout=60)
    assert fits.status_code == 200 and seen == [300]


def test_stop_strings_past_their_limits_are_a_400(server):
    strings = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "stop": strings}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS} stop strings" in r.json()["error"]["message"]


# --- a hung engine ------------------------------------------------------------------------------
def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.1)
    return value


def test_a_stopped_engine_is_a_503_and_its_requests_end_until_it_answers_again():
    """With the engine process stopped (SIGSTOP), /health answered 200 and requests waited for ever.
    Now its silence past --engine-timeout (here 5 s; its heartbeat comes every second) makes
    /health and new requests 503, and ends the stream in flight with an error event; once it is
    continued, it is healthy again and serves."""
    with served() as s:
        s.engine.timeout_s = 5.0
        pid = s.engine.process.pid
        time.sleep(2 * 1.0 + 0.5)  # idle past two heartbeats: healthy (as soon as a heartbeat is read)
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, "an idle engine is not healthy")
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")  # it runs
                os.kill(pid, signal.SIGSTOP)
                events = [x for x in lines if x.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and "has not answered for" in events[-2], events[-2:]
            health = wait_for(lambda: (h := httpx.get(s.url + "/health")).status_code == 503 and h,
                              "/health never said 503")
            assert "--engine-timeout" in health.text
            refused = httpx.post(s.url + "/v1/completions", json=body | {"stream": False}, timeout=60)
            assert refused.status_code == 503 and "has not answered for" in refused.json()["error"]["message"]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, "/health never came back")
        again = httpx.post(s.url + "/v1/completions", json=body | {"stream": False, "max_tokens": 3}, timeout=60)
        assert again.status_code == 200
        s.settle()
