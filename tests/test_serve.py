"""`pagedcli serve`: the real server (uvicorn in a thread with the engine in its own process, as
the command runs it, or the command as a subprocess) on a free loopback port, the built-in model,
called through the official `openai` client and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import ASSETS  # noqa: E402
from helpers import (assert_one_line, check_block_accounting, engine_process_of, invoke, serve_build,  # noqa: E402
                     start_server)

TEMPLATE = ASSETS / "chat" / "chat_template.jinja"
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING"]


class Served:
    """A server in this process: the app pagedcli serve builds, on uvicorn in a thread, and its
    engine in an engine process, as pagedcli serve starts it."""

    def __init__(self, batch: int = 8, max_waiting: int | None = None, api_key: str | None = None, model: str = "demo",
                 poison: bool = False, **engine):
        import uvicorn

        from pagedcli.commands.serve import make_server
        from pagedcli.engine.sequence import SamplingParams
        from pagedcli.serve.app import Settings, create_app
        from pagedcli.serve.engine_client import EngineClient
        from pagedcli.serve.metrics import Metrics

        self.api_key = api_key
        self.metrics = Metrics()
        self.engine = EngineClient(serve_build, (model, batch, engine, str(TEMPLATE), poison), self.metrics)
        self.ready = self.engine.start()
        settings = Settings(model, SamplingParams(), api_key)
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


@pytest.fixture(scope="module")
def server():
    with served() as s:
        yield s


@pytest.fixture(scope="module")
def one_slot():
    """One running request at a time, one more waiting, and a key: for the tests of what waits."""
    with served(batch=1, max_waiting=1, api_key="sekrit") as s:
        yield s


def generate_json(*args) -> list[dict]:
    code, out, err = invoke("generate", "--model", "demo", "--device", "cpu", "--json", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


# --- answers ----------------------------------------------------------------------------------
def test_completions_streamed_and_not_are_generates_answers(server):
    records = generate_json("--raw", "--temperature", "0", "--max-tokens", "24", *PROMPTS)
    client = server.client()
    whole = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [r["text"] for r in records]
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == sum(len(r["token_ids"]) for r in records)
    assert whole.usage.prompt_tokens == sum(len(r["prompt_token_ids"]) for r in records)
    for prompt, record in zip(PROMPTS, records):
        pieces, usage, finish = [], None, None
        counted = 0
        for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}):
            usage = chunk.usage
            assert usage.completion_tokens >= counted and usage.prompt_tokens == len(record["prompt_token_ids"])
            counted = usage.completion_tokens
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        assert "".join(pieces) == record["text"]
        assert len(pieces) > 5, "streamed token by token, not in one piece"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(record["prompt_token_ids"]), len(record["token_ids"]))
        assert finish == record["finish_reason"]
    server.settle()


def test_chat_streamed_and_not_is_generates_chat_answer(server):
    expected = generate_json("--chat", "--chat-template", str(TEMPLATE), "--temperature", "0", "--max-tokens", "20",
                             "Who art thou?")[0]
    client = server.client()
    messages = [{"role": "user", "content": "Who art thou?"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].finish_reason == expected["finish_reason"]
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == expected["finish_reason"]


def test_sampling_options_seeds_n_stop_and_logprobs_are_generates(server):
    client = server.client()
    expected = generate_json("--raw", "--temperature", "0.9", "--top-k", "40", "--seed", "5", "--n", "2",
                             "--max-tokens", "16", "--frequency-penalty", "0.5", "ROMEO:")
    got = client.completions.create(model="demo", prompt="ROMEO:", temperature=0.9, seed=5, n=2, max_tokens=16,
                                    frequency_penalty=0.5, extra_body={"top_k": 40})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r["text"] for r in expected]
    stopped = client.completions.create(model="demo", prompt="ROMEO:", temperature=0, max_tokens=40, stop=["\n\n"])
    assert stopped.choices[0].finish_reason == "stop" and "\n\n" not in stopped.choices[0].text
    assert stopped.choices[0].text == generate_json("--raw", "--temperature", "0", "--max-tokens", "40", "--stop",
                                                    "\n\n", "ROMEO:")[0]["text"]
    lp = client.completions.create(model="demo", prompt="ROMEO:", temperature=0, max_tokens=6, logprobs=3)
    entries = lp.choices[0].logprobs
    assert len(entries.tokens) == 6 and len(entries.token_logprobs) == 6
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in entries.top_logprobs)
    assert entries.text_offset == [sum(len(t) for t in entries.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    server.settle()


def test_32_concurrent_streams_each_answer_its_solo_run_and_every_block_comes_back(make_engine):
    from pagedcli.engine.sequence import SamplingParams
    from pagedcli.model.tokenizer import StreamDecoder

    def request(i: int) -> dict:
        sampled = {"temperature": 0.8, "seed": i} if i % 3 == 0 else {"temperature": 0.0}
        return dict(prompt=PROMPTS[i % 4] + " " * (i % 5), max_tokens=6 + 2 * (i % 5), **sampled)

    solo_engine = make_engine("demo", batch=8, num_blocks=50)  # the server's engine, each request alone in it
    solo = []
    for i in range(32):
        r = request(i)
        ids = solo_engine.tokenizer.encode(r.pop("prompt"))
        seq = solo_engine.engine.add_request(ids, SamplingParams(**r))
        while solo_engine.engine.has_unfinished:
            solo_engine.engine.step()
        solo.append(StreamDecoder(solo_engine.tokenizer, ids).catch_up(seq.output_token_ids))

    with served(batch=8, num_blocks=50) as s:  # a small pool: blocks run short, requests queue and are preempted
        async def one(aclient, i: int) -> str:
            pieces = []
            async for chunk in await aclient.completions.create(model="demo", stream=True, **request(i)):
                pieces += [c.text for c in chunk.choices]
            assert len(pieces) > 1
            return "".join(pieces)

        async def all_at_once():
            aclient = s.async_client()
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

        together = asyncio.run(all_at_once())
        assert together == solo
        s.settle()
        assert s.metrics.preemptions > 0, "the pool was meant to run short"
        assert s.metrics.num_steps < sum(6 + 2 * (i % 5) for i in range(32)) / 2, "they ran in one batch"


def test_clients_that_go_away_mid_stream_leave_nothing_behind(server):
    client = server.client()
    expected = client.completions.create(model="demo", prompt="KING", max_tokens=64, temperature=0).choices[0].text
    aborted = server.metrics.num_aborted
    streams = []
    for i in range(3):  # they stop reading after a few chunks and hang up
        stream = client.completions.create(model="demo", prompt=PROMPTS[i], max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for _, _chunk in zip(range(3), stream):
            pass
        streams.append(stream)
    other = client.completions.create(model="demo", prompt="KING", max_tokens=64, temperature=0, stream=True)
    for stream in streams:
        stream.close()
    assert "".join(c.choices[0].text for c in other if c.choices) == expected, "the others are unharmed"
    server.settle()
    assert server.metrics.num_aborted == aborted + 3


def test_a_streamed_request_is_in_the_engine_before_its_answer_starts(server):
    """The route submits its job before it returns (not once a streaming task first runs, after
    whatever requests the event loop took meanwhile): nothing is sent to the client before the job
    is in the engine, and a client gone before the first token has it aborted."""
    from pagedcli.engine.sequence import SamplingParams
    from pagedcli.serve.app import Settings, create_app
    from pagedcli.serve.engine_client import Delta

    class Engine:  # the EngineClient's face to the routes, answering each job at once
        num_waiting, alive = 0, True

        def __init__(self):
            self.submitted, self.aborted = [], []

        def waiting_with(self, answers):
            return 0

        def submit(self, job):
            self.submitted.append(job)
            if not hang_up:
                job.deliver(Delta(0, [7], " x", [], "length"))

        def abort(self, job):
            self.aborted.append(job)

    async def post(app, body: dict) -> list[dict]:
        sent, raw = [], json.dumps(body).encode()
        messages = [{"type": "http.request", "body": raw, "more_body": False}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.sleep(60)

        async def send(message):
            assert engine.submitted, f"{message['type']} was sent before the job reached the engine"
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    for hang_up in (False, True):
        engine = Engine()
        app = create_app(engine, server.ready, Settings("demo", SamplingParams()), server.metrics)
        sent = asyncio.run(post(app, {"model": "demo", "prompt": "KING", "max_tokens": 1, "stream": True}))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        body = b"".join(m.get("body", b"") for m in sent[1:])
        if hang_up:  # the client went away with no token sent: its job is aborted
            assert engine.aborted == engine.submitted and b"[DONE]" not in body
        else:
            assert b'"text":" x"' in body and body.endswith(b"data: [DONE]\n\n") and not engine.aborted


def test_a_stream_that_fails_past_its_first_byte_ends_with_an_error_event(server, monkeypatch):
    """A bug while a stream runs (its 200 sent): an error event and [DONE], not a cut connection;
    its job is aborted and the others go on."""
    from pagedcli.serve.responses import Shapes

    real, calls = Shapes.chunk, []

    def chunk(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in a chunk")
        return real(self, *args)

    monkeypatch.setattr(Shapes, "chunk", chunk)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                      json={"model": "demo", "prompt": "KING", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]", events[-3:]
    assert "the stream failed: RuntimeError: a bug in a chunk" in events[-2] and len(events) == 4
    monkeypatch.undo()
    server.settle()  # aborted: every block back
    again = server.client().completions.create(model="demo", prompt="KING", max_tokens=5, temperature=0)
    assert again.usage.completion_tokens == 5


def test_a_client_that_gives_up_waiting_for_a_whole_answer_is_aborted(one_slot):
    s = one_slot
    client = s.client()
    aborted = s.metrics.num_aborted
    busy = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=400, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(busy))  # it holds the only slot
    with pytest.raises(openai.APITimeoutError):
        s.client(timeout=0.3).completions.create(model="demo", prompt="KING", max_tokens=50)
    deadline = time.monotonic() + 5
    while s.metrics.num_aborted < aborted + 1:  # the waiting one, not the running one
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert s.engine.num_waiting == 0 and s.metrics.running == 1
    busy.close()
    s.settle()
    assert (s.metrics.running, s.metrics.used_blocks) == (0, 0), "the gauges saw the abort (and no step after it)"


# --- bad requests -----------------------------------------------------------------------------
LONG = list(range(5, 605))  # 600 token ids: more than the demo model's 512 positions
BAD = [
    (b'{"prompt": "ROMEO:", "max_tokens": 5', None, "not valid JSON"),
    (b'["ROMEO:"]', None, "must be a JSON object"),
    (b'{"max_tokens": 5}', "prompt", "`prompt` is required"),
    (b'{"prompt": "ROMEO:", "max_tokens": "5"}', "max_tokens", "`max_tokens`: \"5\" should be a valid integer"),
    (b'{"prompt": "ROMEO:", "temperature": true}', "temperature", "should be a valid number"),
    (b'{"prompt": 17}', "prompt", "`prompt`: 17 is not one of the types it takes"),
    (b'{"prompt": "ROMEO:", "max_tokens": 600}', "max_tokens", "maximum length is 512 tokens"),
    (json.dumps({"prompt": LONG}).encode(), "prompt", "the prompt has 600 tokens"),
    (b'{"prompt": [5, 99999]}', "prompt", "token id 99999 is outside the model's vocabulary"),
    (b'{"prompt": []}', "prompt", "`prompt` is an empty list"),
    (b'{"prompt": "ROMEO:", "temperature": -1}', "temperature", "`temperature` -1.0: must be 0"),
    (b'{"prompt": "ROMEO:", "top_p": 1.5}', "top_p", "`top_p` 1.5: must be in (0, 1]"),
    (b'{"prompt": "ROMEO:", "logprobs": 50}', "logprobs", "`logprobs` 50: must be from 0 to 20"),
    (b'{"prompt": "ROMEO:", "n": 0}', "n", "`n` 0"),
    (b'{"prompt": "ROMEO:", "stop": [""]}', "stop", "must not be empty"),
    (b'{"prompt": "ROMEO:", "presence_penalty": 3}', "presence_penalty", "must be in [-2, 2]"),
    # OpenAI's fields this server does not do: said, not ignored
    (b'{"prompt": "ROMEO:", "echo": true}', "echo", "`echo` (the prompt in the answer) is not supported"),
    (b'{"prompt": "ROMEO:", "best_of": 3}', "best_of", "`best_of` 3: not supported"),
    (b'{"prompt": "ROMEO:", "suffix": "x"}', "suffix", "`suffix`"),
    (b'{"prompt": "ROMEO:", "stream_options": {"include_usage": true}}', "stream_options",
     "`stream_options` is for a streamed answer"),  # (vLLM's 400: no stream, nothing would read them)
    # bodies that were 500s with a traceback: a lone surrogate (the tokenizer's TypeError), nesting past
    # Python's recursion limit, a number past its 4,300 digits (json's ValueError)
    (b'{"prompt": ["ok", "a\\ud800"]}', "prompt[1]", "`prompt[1]` is not valid Unicode text (a lone surrogate U+D800"),
    (b'{"prompt": "ROMEO:", "\\udfff": 1}', None, "a key of the body is not valid Unicode text"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests arrays or objects too deeply"),
    (b'{"prompt": [' + b"9" * 5000 + b"]}", None, "a number with thousands of digits"),
    # one prompt of several at fault: it is named (it was `prompt`, whichever of a thousand it was)
    (b'{"prompt": [[1, 2], []]}', "prompt[1]", "`prompt[1]`: the prompt is empty"),
    (b'{"prompt": ["ok", "' + b"word " * 600 + b'"]}', "prompt[1]", "`prompt[1]`: the prompt has"),
    (b'{"prompt": [[1], [2], [5000]]}', "prompt[2]", "`prompt[2]`: token id 5000 is outside"),
    # one that made a NaN distribution: the draw's error failed the whole step, its batch mates too
    (b'{"prompt": "ROMEO:", "temperature": 1, "repetition_penalty": 1e-300}', "repetition_penalty",
     "`repetition_penalty` 1e-300: must be a positive number from 0.0001 to 10000"),
]


@pytest.mark.parametrize("body, param, fragment", BAD, ids=[f[2][:30] for f in BAD])
def test_a_bad_completion_request_is_a_400_naming_the_field(server, body, param, fragment):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and fragment in error["message"], error


def test_a_field_given_as_null_takes_its_default_as_openais_api_reads_it(server):
    """OpenAI's API takes null for every optional field (clients that fill in every field send
    them): `"n": null` is one answer, `"stream": null` no stream; they were 400s."""
    nulls = {"n": None, "stream": None, "stream_options": None, "logprobs": None, "echo": None, "stop": None,
             "max_tokens": None, "temperature": None}
    body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=nulls | body)
    assert r.status_code == 200, r.text
    expected = httpx.post(server.url + "/v1/completions", json=body).json()["choices"]
    assert r.json()["choices"] == expected and len(expected) == 1
    chat = {"model": "demo", "max_tokens": 2, "n": None, "stream": None, "logprobs": None, "top_logprobs": None,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "demo", "prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_bad_chat_requests_and_other_requests_unharmed(server):
    client = server.client()
    running = client.completions.create(model="demo", prompt="KING", max_tokens=80, temperature=0, stream=True)
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]},
                                                         "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "demo"} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    expected = client.completions.create(model="demo", prompt="KING", max_tokens=80, temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in running) == expected
    server.settle()


def test_a_chat_template_that_refuses_the_messages_is_a_400_with_a_clients_way_out(server, monkeypatch):
    """A template's raise_exception (roles must alternate, as many models' do) is the client's
    400, with a way out for a client (it said generate's hint: "use `raw` to feed the prompt")."""
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}"
                "{% endif %}{{ messages[0]['content'] }}")
    monkeypatch.setattr(server.ready.tokenizer, "chat_template", template)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "demo", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    message = r.json()["error"]["message"]
    assert "the first message must be the user" in message and "/v1/completions" in message and "raw" not in message
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_in_a_chat_message_is_a_400_and_an_escaped_emoji_is_text(server):
    def chat(body: dict) -> httpx.Response:  # json.dumps writes non-ASCII as escapes: 😀 as \ud83d\ude00
        return httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body))

    for content in ["\ud800", [{"type": "text", "text": "x\udfff"}]]:
        r = chat({"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("messages[0].content") and "U+D" in r.json()["error"]["message"]
    assert chat({"messages": [{"role": "user", "content": "😀"}], "max_tokens": 2}).status_code == 200


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


def test_a_client_gone_before_its_body_came_whole_leaves_no_traceback(server):
    with uvicorn_error_records() as (records, _):
        with socket.create_connection(server.sock.getsockname()) as sock:  # 100 bytes promised, 10 sent
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
            deadline = time.monotonic() + 2
            while not server.server.server_state.tasks:  # the route is waiting for the rest
                assert time.monotonic() < deadline
                time.sleep(0.01)
        while server.server.server_state.tasks:  # then hears of the disconnect and ends
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert [r for r in records if r.levelno >= logging.ERROR] == []


def test_a_long_text_is_tokenized_off_the_event_loop_while_other_requests_go_on(server, monkeypatch):
    """It was tokenized on the event loop: a 10 MB prompt stalled every stream for 5 s. Here the
    tokenizer takes 0.5 s (a sleep lets go of the GIL, as its encode_batch does)."""
    tokenizer = server.ready.tokenizer
    encode, threads = tokenizer.encode, []

    def slow_encode(text, *args, **kw):
        threads.append(threading.current_thread())
        if len(text) > 100_000:
            time.sleep(0.5)
        return encode(text, *args, **kw)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    big = threading.Thread(target=lambda: threads.append(httpx.post(server.url + "/v1/completions", timeout=10,
                                                                    json={"prompt": "hello " * 20_000})))
    big.start()
    while not threads:
        time.sleep(0.01)
    started = time.monotonic()
    small = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
    assert small.status_code == 200 and time.monotonic() - started < 0.4, "the small request waited for the big one"
    big.join()
    assert threads[0] is not server.thread, "the big body was tokenized on the event loop's thread"
    assert threads[-1].status_code == 400 and "the prompt has 40,003 tokens" in threads[-1].json()["error"]["message"]


def test_a_request_of_more_answers_than_may_run_and_wait_is_a_400(one_slot):
    headers = {"Authorization": "Bearer sekrit"}  # 1 slot, --max-waiting 1: 2 answers at most
    for body, param in [({"prompt": "x", "n": 3}, "n"), ({"prompt": ["x", "y", "z"]}, "prompt")]:
        r = httpx.post(one_slot.url + "/v1/completions", json=body | {"max_tokens": 1}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        message = r.json()["error"]["message"]
        assert "asks for 3 answers" in message and "--max-waiting 1" in message, message
    r = httpx.post(one_slot.url + "/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1}, headers=headers)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_past_max_waiting_is_429_and_a_wrong_key_401(one_slot):
    s = one_slot
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").models.list()
    assert httpx.get(s.url + "/health").status_code == 200, "only /v1 asks for the key"
    lower = httpx.get(s.url + "/v1/models", headers={"Authorization": "bearer sekrit"})
    assert lower.status_code == 200, "the scheme's case does not count (RFC 7235)"
    client = s.client(api_key="sekrit")
    assert [m.id for m in client.models.list().data] == ["demo"]
    s.engine.num_sent += 1  # a request on its way to the engine takes the free slot: it does not wait
    assert s.engine.num_free_slots == 1 and s.engine.num_waiting == 0
    s.engine.num_sent -= 1
    first = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=300, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(first))  # running
    with pytest.raises(openai.RateLimitError) as e:  # none waits yet, but both of its answers would: 2 > 1
        client.completions.create(model="demo", prompt="KING", max_tokens=5, n=2)
    assert "this request's 2 answers would pass its --max-waiting (1)" in e.value.body["message"], e.value.body
    second = client.completions.create(model="demo", prompt="KING", max_tokens=5, temperature=0, stream=True)
    while s.engine.num_waiting < 1:  # (its job is queued once its response starts)
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:  # the second waits: a third is one too many
        client.completions.create(model="demo", prompt="KING", max_tokens=5)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    assert e.value.body["message"].startswith("the server has 1 answer waiting for a slot already"), e.value.body
    first.close()
    assert "".join(c.choices[0].text for c in second if c.choices), "the waiting one runs once a slot frees"
    s.settle()


# --- what the server shows --------------------------------------------------------------------
def test_metrics_parse_and_count_what_ran(server):
    from prometheus_client.parser import text_string_to_metric_families

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}

    before = families()
    got = server.client().completions.create(model="demo", prompt=PROMPTS[:2], max_tokens=10, temperature=0)
    server.settle()
    after = families()

    def value(fams, name, sample=None) -> float:
        return next(s.value for s in fams[name].samples if s.name == (sample or name))

    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_preemptions", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"), ("pagedcli:kv_blocks_free", "gauge"),
                       ("pagedcli:prefix_cache_hit_rate", "gauge"), ("vllm:prefix_cache_hits", "counter")]:
        assert after[name].type == kind, name
    tokens = "vllm:generation_tokens_total"
    assert value(after, "vllm:generation_tokens", tokens) - value(before, "vllm:generation_tokens", tokens) \
        == got.usage.completion_tokens
    ttft = "vllm:time_to_first_token_seconds_count"
    assert value(after, "vllm:time_to_first_token_seconds", ttft) - value(before, "vllm:time_to_first_token_seconds",
                                                                          ttft) == 2
    itl = "vllm:inter_token_latency_seconds_count"  # one a token after each answer's first
    assert value(after, "vllm:inter_token_latency_seconds", itl) - value(before, "vllm:inter_token_latency_seconds",
                                                                         itl) == got.usage.completion_tokens - 2
    assert value(after, "pagedcli:kv_blocks_free") == server.ready.geometry.num_blocks
    assert value(after, "vllm:num_requests_running") == 0


def test_the_cache_endpoint_shows_inspect_caches_fields_per_running_request(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "watch-me"},
                      json={"prompt": PROMPTS[2], "max_tokens": 300, "stream": True, "ignore_eos": True}) as r:
        assert r.headers["x-request-id"] == "watch-me"
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        cache = httpx.get(server.url + "/v1/cache").json()
    running = cache["running"]
    assert [entry["request_id"] for entry in running] == ["watch-me"]
    entry = running[0]
    assert set(entry) == {"request_id", "slot", "step", "geometry", "free_blocks", "used_blocks", "request",
                          "prompt_token_ids", "output_token_ids", "num_cached", "prefill", "layers"}
    assert entry["request"]["prompt"] == PROMPTS[2] and entry["output_token_ids"]
    assert entry["prompt_token_ids"] == server.ready.tokenizer.encode(PROMPTS[2])
    geo = server.ready.geometry
    layers = entry["layers"]
    assert len(layers) == geo.num_layers
    assert all(len(layer["blocks"]) >= -(-entry["num_cached"] // geo.block_size) for layer in layers)
    assert cache["used_blocks"] == sum(len(layer["blocks"]) for layer in layers), "its blocks are all in use"
    assert layers[0]["blocks"][0]["k_offset"] == layers[0]["blocks"][0]["physical"] * geo.block_bytes
    server.settle()


def test_random_weights_are_served_for_token_id_prompts(tiny):
    """A benchmark through the server with random weights (no tokenizer): token ids in, usage out."""
    with served(batch=4, model=f"random:{tiny}") as s:
        client = s.client()
        got = client.completions.create(model=f"random:{tiny}", prompt=[[5, 6, 7], [8, 9]], max_tokens=7,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 14 and [c.text for c in got.choices] == ["", ""]
        chunks = list(client.completions.create(model=f"random:{tiny}", prompt=[5, 6, 7], max_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert chunks[-1].usage.completion_tokens == 5
        for prompt, param in [("a text", "prompt"), ([5, 6], "stop")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=f"random:{tiny}", prompt=prompt, max_tokens=3, stop=["x"])
            assert e.value.body["param"] == param
        assert httpx.get(s.url + "/v1/cache").json()["running"] == []
        s.settle()


def test_models_and_health(server):
    models = server.client().models.list().data
    assert [(m.id, m.owned_by) for m in models] == [("demo", "pagedcli")]
    assert server.client().models.retrieve("demo") == models[0]  # OpenAI's GET /v1/models/{model} (was a 404)
    with pytest.raises(openai.NotFoundError) as e:
        server.client().models.retrieve("org/other")
    assert e.value.body["code"] == "model_not_found" and "'org/other'" in e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    # HEAD where GET is (HTTP asks it of every server; monitors probe with it): it was a 405
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_other_methods_on_the_post_routes_are_405_saying_allow_post(server):
    for route in ("/v1/completions", "/v1/chat/completions"):
        for method in ("GET", "HEAD", "PUT"):
            r = httpx.request(method, server.url + route)
            assert r.status_code == 405 and r.headers.get("allow") == "POST", (route, method, r.headers)
            assert method == "HEAD" or r.json()["error"]["message"] == f"{method} {route}: not allowed here (it takes POST)"


# --- the command ------------------------------------------------------------------------------
def test_the_answers_id_is_the_request_id_header(server):
    """One id a request: the body's `id` is the X-Request-Id header, given or made."""
    body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 2}
    given = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "mine-1"})
    assert given.headers["x-request-id"] == "mine-1" and given.json()["id"] == "mine-1"
    made = httpx.post(server.url + "/v1/completions", json=body)
    assert made.json()["id"] == made.headers["x-request-id"] and made.json()["id"].startswith("cmpl")


def test_a_failed_add_or_step_fails_its_requests_and_a_killed_engine_is_503_at_once():
    """A request whose adding raises (a bug) gets a 500 and the next is answered; a step that
    raises ends the requests in it and the server goes on; once the engine process is killed, a
    stream in flight ends with an error event, and /health and new requests get 503 at once."""
    with served(poison=True) as s:
        body = {"model": "demo", "max_tokens": 3}
        bad = httpx.post(s.url + "/v1/completions", json=body | {"prompt": "POISON"}, timeout=10)
        assert bad.status_code == 500 and "a bug in adding" in bad.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json=body | {"prompt": "ROMEO:"}, timeout=10).status_code == 200
        crash = httpx.post(s.url + "/v1/completions", json=body | {"prompt": "CRASH"}, timeout=10)
        assert crash.status_code == 500 and "the engine failed: a bug in the step" in crash.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json=body | {"prompt": "KING"}, timeout=10).status_code == 200
        s.settle()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=10,
                          json=body | {"prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # it runs
            os.kill(s.engine.process.pid, signal.SIGKILL)
            events = [x for x in lines if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "engine process has stopped" in events[-2], events[-2:]
        assert httpx.get(s.url + "/health").status_code == 503
        gone = httpx.post(s.url + "/v1/completions", json=body | {"prompt": "KING"}, timeout=10)
        assert gone.status_code == 503 and gone.json()["error"]["type"] == "server_error"
        assert httpx.get(s.url + "/v1/cache").status_code == 503


def test_an_engine_killed_before_the_first_request_is_503_for_a_stream_too():
    """Nothing reads the engine's pipe before the first request (so no EOF says it is gone): the
    first request, streamed, was a 200 with an error event instead of the 503 every later one gets."""
    with served() as s:
        os.kill(s.engine.process.pid, signal.SIGKILL)
        s.engine.process.join(10)
        body = {"model": "demo", "prompt": "KING", "max_tokens": 3, "stream": True}
        first = httpx.post(s.url + "/v1/completions", json=body, timeout=10)
        assert first.status_code == 503 and first.json()["error"]["type"] == "server_error", first.text


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_ctrl_c_right_after_the_serving_line_stops_it_cleanly(api_servers):
    """The line says Ctrl-C stops it, so a Ctrl-C from then on is a stop, exit 0, even before
    uvicorn has taken the signals (it used to end the command with 130 and "interrupted" while the
    heap was collected before the server ran: a flaky multi-process test found it)."""
    proc, _ = start_server("--api-server-count", api_servers)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "stopped by SIGINT" in err and "interrupted" not in err and "Traceback" not in err, err
    finally:
        proc.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_a_hang_up_finishes_what_runs_and_exits_0(signum):
    """To the whole process group, as a service manager's stop or a closed terminal sends it: the
    engine's process too, which leaves the stop to the API process (a hang-up used to kill it, and
    the API process ended with a traceback, cutting the stream)."""
    proc, url = start_server()
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        first = next(iter(stream))
        os.killpg(proc.pid, signum)
        rest = list(stream)
        assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 40, \
            "the request in flight is finished"
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert f"stopped by {signal.Signals(signum).name}: 1 answer finished" in err and "Traceback" not in err, err
        assert first.choices[0].text
    finally:
        proc.kill()


def test_a_server_whose_log_reader_has_gone_serves_on_and_exits_0():
    """stderr a pipe whose reader ended (`serve 2>&1 | grep -m1 serving`, a log collector
    restarted): the lines are lost, the server is not (rich's broken-pipe SystemExit(1) ended it at
    its next notice: the `stopped` line turned a clean SIGTERM into exit 1)."""
    proc, url = start_server()
    try:
        proc.stderr.close()
        engine = engine_process_of(proc.pid)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        chunks = list(client.completions.create(model="demo", prompt="ROMEO:", max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
        # (a busy machine may carry two tokens' text in one chunk: count the tokens, not the chunks)
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert left_behind([engine]) == []
    finally:
        proc.kill()


def test_a_stream_cut_at_the_shutdown_deadline_leaves_no_traceback():
    """A client that stopped reading keeps its stream's ending from being written, so uvicorn
    cancels that handler at its shutdown deadline (GRACE_S + CLOSE_S) and logged the CancelledError
    as "Exception in ASGI application" with a traceback (SIGTERM with three clients not reading
    8 answers of logprobs each); its own one-line error before it says what happened. (Through
    the loggers as the server sets them up: the real cut takes the deadline's 15 s.)"""
    from pagedcli.commands.serve import quiet_startup

    quiet_startup(None)
    with uvicorn_error_records() as (records, log):
        log.error("Cancel 1 running task(s), timeout graceful shutdown exceeded")
        cut = asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")
        log.error("Exception in ASGI application\n", exc_info=(type(cut), cut, None))
        bug = ValueError("a bug")
        log.error("Exception in ASGI application\n", exc_info=(type(bug), bug, None))
    assert [(r.getMessage(), r.exc_info and r.exc_info[0]) for r in records] == [
        ("Cancel 1 running task(s), timeout graceful shutdown exceeded", None),
        ("Exception in ASGI application\n", ValueError)]  # a bug's traceback stays


def test_an_engine_process_serves_each_link_its_own_and_outlives_one_gone(make_engine):
    """Two API processes' links into one engine process: the same request key on both is two
    requests, each link's messages carry its own answer only; a link whose process is gone (its
    pipe closed) has its request aborted, and the other's runs to its end; the last stop ends it."""
    import multiprocessing

    from pagedcli.engine.sequence import SamplingParams
    from pagedcli.serve.engine_process import EngineProcess, Link
    from pagedcli.serve.sampling import Prompts

    loaded = make_engine("demo", batch=4, num_blocks=64)
    ids = loaded.tokenizer.encode("ROMEO:")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    solo = loaded.engine.run_to_completion([ids], params)[0].output_token_ids
    loaded.engine.forget()
    links, apis = [], []
    for _ in range(2):
        messages_in, messages_out = multiprocessing.Pipe(duplex=False)
        commands_in, commands_out = multiprocessing.Pipe(duplex=False)
        links.append(Link(messages_out, commands_in))
        apis.append((messages_in, commands_out))
    process = EngineProcess(links, loaded.engine)
    thread = threading.Thread(target=process.run, daemon=True)
    thread.start()
    for _, commands in apis:
        commands.send(("add", 1, "r", time.perf_counter(), Prompts([ids], [None], [[params]])))

    def read(messages) -> tuple[list[int], str | None]:
        """One link's answer to request 1: its tokens, and how it ended (None: not yet)."""
        kind, tokens, deltas, _report = messages.recv()
        assert kind == "step"
        triples = iter(tokens)
        got = [t for key, index, t in zip(triples, triples, triples) if (key, index) == (1, 0)]
        ended = None
        for key, index, token_ids, _text, _logprobs, finish, _error in deltas:
            assert (key, index) == (1, 0)
            got += token_ids
            ended = finish or ended
        return got, ended

    first = []
    while len(first) < 3:
        first += read(apis[1][0])[0]
    apis[1][1].close()  # the second API process is gone
    answer, ended = [], None
    while ended is None:
        got, ended = read(apis[0][0])
        answer += got
    assert (answer, ended) == (solo, "length"), "the first link's answer runs whole"
    assert first == solo[:len(first)]
    with pytest.raises(EOFError):  # the gone link's pipe was let go (after its last messages)
        while True:
            apis[1][0].recv()
    assert thread.is_alive() and loaded.engine.num_forgotten["aborted"] == 1
    apis[0][1].send(("stop",))
    thread.join(10)
    assert not thread.is_alive() and not loaded.engine.has_unfinished
    check_block_accounting(loaded.engine)


def left_behind(pids: list[int], within: float = 10.0) -> list[int]:
    """Those of `pids` still running (not zombies) after `within` seconds (multiprocessing's
    resource tracker, say, ends a moment after the server)."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for pid in pids:
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(pid)
            except FileNotFoundError:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_two_api_processes_serve_one_engine_and_stop_together():
    """--api-server-count 2: both API processes take connections for the one engine, every answer
    is its solo run's, /metrics (either process's) counts the whole server; a terminal's Ctrl-C
    (SIGINT to the group) stops them all, exit 0, every process gone."""
    proc, url = start_server("--batch", "8", "--api-server-count", "2")
    try:
        children = children_of(proc.pid)
        other = other_api_process(proc.pid)
        idle = num_sockets(other)
        prompts = ["ROMEO:", "KING", "To be", "JULIET:"]

        async def run():
            clients = [openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) for _ in range(24)]

            async def one(i: int) -> str:
                got = await clients[i].completions.create(model="demo", prompt=prompts[i % 4], max_tokens=12,
                                                          temperature=0, stream=i % 2 == 0)
                if i % 2:
                    return got.choices[0].text
                return "".join([c.text async for chunk in got for c in chunk.choices])

            answers = await asyncio.gather(*(one(i) for i in range(24)))
            taken = num_sockets(other) - idle  # the kept-alive connections the other process accepted
            for c in clients:
                await c.close()
            return answers, taken

        answers, taken = asyncio.run(run())
        solo = [openai.OpenAI(base_url=url, api_key="none", max_retries=0).completions.create(
            model="demo", prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
        assert answers == [solo[i % 4] for i in range(24)]
        assert 0 < taken < 24, f"the other API process accepted {taken} of 24 connections"
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert f'vllm:generation_tokens_total{{model_name="demo"}} {28 * 12}' in metrics
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "stopped by SIGINT: 28 answers finished" in err and "Traceback" not in err, err
        # uvicorn's start and stop lines stay quiet in the other process too (it said "Started
        # server process", "Shutting down", "Finished server process")
        assert not [line for line in proc.start_lines + err.splitlines() if line.startswith("INFO:     ")
                    and '"' not in line], (proc.start_lines, err)
        assert not left_behind(children), "a process was left behind"
    finally:
        proc.kill()


def test_killing_the_first_of_two_api_processes_ends_them_all():
    """SIGKILL to the server (the first API process): the other API process and the engine's
    process end too, nothing is left holding the port or the model."""
    proc, url = start_server("--api-server-count", "2")
    children = children_of(proc.pid)
    assert len(children) >= 2
    proc.kill()
    proc.wait()
    assert not left_behind(children, within=20), "a process was left behind"


def other_api_process(pid: int) -> int:
    """The other API process of `pagedcli serve --api-server-count 2` (process `pid`)."""
    engine = engine_process_of(pid)
    return next(p for p in children_of(pid) if p != engine and "resource_tracker" not in open(f"/proc/{p}/cmdline").read())


def children_of(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def num_sockets(pid: int) -> int:
    return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def streams_on_both(url: str, other: int, body: dict):
    """Streams (each on a connection of its own, read to its first event) opened until the other
    API process holds one too (the kernel picks the process): (response, line iterator) pairs,
    the last one the other process's, the rest the first's."""
    from contextlib import ExitStack

    idle = num_sockets(other)
    with ExitStack() as stack:
        streams = []
        while num_sockets(other) == idle:
            assert len(streams) < 32, "the other API process took no connection"
            client = stack.enter_context(httpx.Client(timeout=10))
            response = stack.enter_context(client.stream("POST", url + "/completions", json=body))
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")  # it runs
            streams.append((response, lines))
        yield streams


def test_a_dead_engine_ends_the_streams_of_every_api_process():
    """--api-server-count 2, the engine's process killed: the streams on either API process end
    with an error event and [DONE] (as with one API process), and no traceback."""
    proc, url = start_server("--api-server-count", "2")
    try:
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with streams_on_both(url, other_api_process(proc.pid), body) as streams:
            os.kill(engine_process_of(proc.pid), signal.SIGKILL)
            endings = [[x for x in lines if x.startswith("data: ")][-2:] for _, lines in streams]
        assert all(e[1] == "data: [DONE]" for e in endings) and "engine process has stopped" in endings[-1][0], endings
        assert all("engine process has stopped" in e[0] or '"finish_reason":"length"' in e[0] for e in endings)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
    finally:
        proc.kill()


def test_ctrl_c_gives_the_other_api_process_its_grace_and_a_second_one_ends_it():
    """--api-server-count 2, Ctrl-C once: the other API process's stream runs on to its end (the
    grace, as with one process) once the first has nothing left to wait for; one Ctrl-C more
    (while the first waits for the other) ends the next stream there with an error event, exit 0."""
    proc, url = start_server("--api-server-count", "2")
    try:
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with streams_on_both(url, other_api_process(proc.pid), body) as streams:
            os.killpg(proc.pid, signal.SIGINT)
            for response, _ in streams[:-1]:  # the first process's: gone, it stops at once
                response.close()
            events = [x for x in streams[-1][1] if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-2:]
        assert proc.wait(30) == 0
        summary = re.search(r"stopped by SIGINT: (\d+) answers? finished", proc.stderr.read())
        # (the other's answer at least: how many of the first's ended before the signal depends on timing)
        assert summary and int(summary.group(1)) >= 1, "the other's answer is counted too"
        proc, url = start_server("--api-server-count", "2")
        with streams_on_both(url, other_api_process(proc.pid), body | {"max_tokens": 500}) as streams:
            os.killpg(proc.pid, signal.SIGINT)
            for response, _ in streams[:-1]:
                response.close()
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
            events = [x for x in streams[-1][1] if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-2:]
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "stopped by SIGINT" in err, err
    finally:
        proc.kill()


def test_sigterm_to_every_process_stops_each_api_process_once():
    """--api-server-count 2, SIGTERM to every process (systemd's stop signals each one of the
    service's, kill -TERM -PGID too; here a moment apart, as the kernel may deliver them): each API
    process counts it once, so the streams on both run on to their ends, exit 0."""
    proc, url = start_server("--api-server-count", "2")
    try:
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        other = other_api_process(proc.pid)
        with streams_on_both(url, other, body) as streams:
            os.kill(other, signal.SIGTERM)
            time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGTERM)
            endings = [[x for x in lines if x.startswith("data: ")][-2:] for _, lines in streams]
        assert all(e[1] == "data: [DONE]" and '"finish_reason":"length"' in e[0] for e in endings), endings
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_the_first_api_process_dying_lets_the_others_streams_finish():
    """The other API processes stop when the first dies (PR_SET_PDEATHSIG), as on a signal: their
    streams run on to their ends; the kernel may signal that death twice (a SIGKILL'd first's
    threads end one by one), which is not a second Ctrl-C."""
    from pagedcli.commands.serve import PARENT_GONE

    proc, url = start_server("--api-server-count", "2")
    try:
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        other = other_api_process(proc.pid)
        with streams_on_both(url, other, body) as streams:
            os.kill(other, PARENT_GONE)
            time.sleep(0.1)
            os.kill(other, PARENT_GONE)
            events = [x for x in streams[-1][1] if x.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-2:]
    finally:
        proc.kill()


def test_a_second_ctrl_c_ends_what_runs_with_an_ending_each_client_reads():
    """Ctrl-C twice at a terminal (SIGINT to the whole process group, the engine's process too):
    past the grace (here: at once, the second one) the answers in flight are aborted by the
    engine, not cut by uvicorn: a stream gets an error event and [DONE], a whole answer a 503 in
    OpenAI's shape; no traceback, exit 0, and the engine's process is gone too."""
    proc, url = start_server()
    url = url.removesuffix("/v1")
    engine = engine_process_of(proc.pid)
    try:
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 500, "ignore_eos": True}  # seconds on a CPU
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                              timeout=30)))
        waiting.start()
        with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # it runs
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            events = [x for x in lines if x.startswith("data: ")]
        waiting.join(30)
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "shutting down" in events[-2], events[-3:]
        assert whole["r"].status_code == 503 and "shutting down" in whole["r"].json()["error"]["message"]
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "stopped by SIGINT" in err, err
        assert not os.path.exists(f"/proc/{engine}"), "the server joins its engine process"
    finally:
        proc.kill()


def test_the_engine_process_ends_when_the_server_is_killed():
    """No orphan holding the model's memory: the engine process sees its pipe close and exits."""
    proc, _ = start_server()
    engine = engine_process_of(proc.pid)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{engine}") and "Z" not in open(f"/proc/{engine}/stat").read().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.05)


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
    from pagedcli.errors import RunError

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


# --- the engine's abort -----------------------------------------------------------------------
def test_abort_ends_one_request_wherever_it_is_and_the_others_go_on(make_engine):
    from pagedcli.engine.sequence import SamplingParams

    engine = make_engine("demo", batch=2, prefix_caching=False).engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [engine.add_request([0, 5 + i, 9], params) for i in range(2)]
    while engine.has_unfinished:
        engine.step()
    expected = [s.output_token_ids for s in alone]
    engine.reset()
    keep = engine.add_request([0, 5, 9], params)
    running = engine.add_request([0, 7, 9, 11], params)
    waiting = engine.add_request([0, 8], params)
    family = engine.add_parallel([0, 3, 4], [replace(params, temperature=1.0, seed=i) for i in range(3)])
    engine.step()
    engine.step()
    engine.abort([running, waiting, family[0]])  # a running one, a waiting one, a parent with waiting samples
    assert all(s.is_finished and s.finish_reason == "abort" for s in [running, waiting, *family])
    check_block_accounting(engine)
    other = engine.add_request([0, 6, 9], params)
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert [keep.output_token_ids, other.output_token_ids] == expected
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    engine.forget()
    assert engine.sequences == [] and engine.snapshot().num_aborted == 5 and engine.snapshot().num_finished == 2
    assert engine.add_request([0, 1], params).id == 7, "ids stay unique after forget()"


def test_the_serve_extra_and_the_test_extra_name_the_servers_packages():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ASSETS.parents[1] / "pyproject.toml").read_text())
    extras = {name: " ".join(packages) for name, packages in project["project"]["optional-dependencies"].items()}
    for name in ("fastapi", "uvicorn", "uvloop", "httptools"):
        assert name in extras["serve"], name
    for name in ("fastapi", "uvicorn", "uvloop", "httptools", "openai", "prometheus_client", "httpx"):
        assert name in extras["test"], name
    assert "pagedcli.serve" in project["tool"]["setuptools"]["packages"]


def test_abort_with_a_decode_step_queued_ahead(tiny, make_engine):
    """The overlap (forced on, as on a GPU): the step queued ahead still holds the aborted row,
    which the next step drops; the others' tokens are those of a run without either."""
    from pagedcli.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    def run(overlap: bool, abort_at: int | None):
        engine = make_engine(tiny, batch=3).engine
        engine.overlap = overlap
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished:
            engine.step()
            if engine.num_steps == abort_at:
                assert engine.in_flight is not None and seqs[1] in engine.in_flight.seqs
                engine.abort([seqs[1]])
                assert engine.in_flight is not None, "the others' step ahead stays"
            check_block_accounting(engine)
        assert engine.in_flight is None and engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        return [s.output_token_ids for s in seqs]

    plain = run(False, None)
    aborted = run(True, 6)
    assert aborted[0] == plain[0] and aborted[2] == plain[2]
    assert aborted[1] == plain[1][:len(aborted[1])] and len(aborted[1]) < 20


@pytest.mark.parametrize("model", ["demo", "stories"])
def test_decoding_several_tokens_at_once_gives_the_same_text(model, stories):
    """A client that fell behind gets its tokens in one piece (StreamDecoder.catch_up_at_once):
    the text is the one decoded token by token, whatever the pieces."""
    import random

    from pagedcli.model.source import DEMO_FOLDER
    from pagedcli.model.tokenizer import StreamDecoder, Tokenizer

    tokenizer = Tokenizer(DEMO_FOLDER if model == "demo" else stories)
    rng = random.Random(3)
    for _ in range(20):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        one_by_one = StreamDecoder(tokenizer, prompt)
        one_by_one.catch_up(output)
        at_once, cut = StreamDecoder(tokenizer, prompt), 0
        while cut < len(output):
            cut += rng.randrange(1, 6)
            at_once.catch_up_at_once(output[:cut])
        assert at_once.text == one_by_one.text


def test_commands_never_block_the_event_loop_and_arrive_whole_and_in_order():
    """The command pipe (serve/command_pipe.py) takes more than a pipe holds while nothing reads it,
    without blocking the event loop; a reader (the engine's Connection.recv) then gets every
    command whole and in order, a command handed over from another thread among them."""
    import multiprocessing

    from pagedcli.serve.command_pipe import PIPE_BYTES, CommandPipe

    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    pipe = CommandPipe(writer)
    big = list(range(PIPE_BYTES // 4))  # more than a pipe holds, pickled
    sent = [("add", i, big if i % 3 == 0 else [i]) for i in range(12)]

    async def main():
        pipe.attach(asyncio.get_running_loop())
        started = time.perf_counter()
        for command in sent[:6]:
            pipe.send(command)
        other = threading.Thread(target=pipe.send, args=(sent[6],))
        other.start()
        other.join()
        await asyncio.sleep(0)  # (the other thread's command joins the queue here)
        for command in sent[7:]:
            pipe.send(command)
        assert time.perf_counter() - started < 1.0 and len(pipe.unsent) > PIPE_BYTES  # waiting, not blocking
        got = await asyncio.to_thread(lambda: [reader.recv() for _ in sent])
        assert not pipe.unsent
        return got

    assert asyncio.run(main()) == sent
    pipe.close()


def test_commands_survive_a_send_from_inside_a_write_a_dead_engine_and_a_closed_loop():
    """A command sent while another is half written (a signal handler's, in the loop's thread)
    waits for the loop instead of cutting into it; a backlog left when the loop closes is written
    by the blocking path, with a command after it; a pipe whose engine has gone takes commands
    without an error, and closes its descriptor."""
    import multiprocessing

    from pagedcli.serve.command_pipe import PIPE_BYTES, CommandPipe, frame

    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    pipe = CommandPipe(writer)
    big = list(range(PIPE_BYTES // 4))  # more than a pipe holds, pickled
    sent = [("add", 0, big), ("end_all",), ("add", 1, big), ("add", 2, [2])]
    write_some, interrupted = pipe._write_some, []

    def write_with_a_signal(data):
        if not interrupted:  # a signal lands inside the first write
            interrupted.append(True)
            pipe.send(sent[1])
        return write_some(data)

    pipe._write_some = write_with_a_signal

    async def main():
        pipe.attach(asyncio.get_running_loop())
        pipe.send(sent[0])
        await asyncio.sleep(0)
        pipe.send(sent[2])
        pipe.send(sent[3])
        assert pipe.unsent  # more than the pipe holds, and nobody reads: left for later

    asyncio.run(main())  # the loop closes with the backlog unsent
    got = []
    reading = threading.Thread(target=lambda: got.extend(reader.recv() for _ in range(len(sent) + 1)))
    reading.start()
    pipe.write_blocking(frame(("stop",)), time.monotonic() + 10)
    reading.join(10)
    assert got == sent + [("stop",)]

    reader.close()  # the engine's end goes away
    pipe.send(("abort", 3))
    assert pipe.broken
    fd = pipe.fd
    pipe.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_stopping_a_server_whose_engine_is_still_building_kills_it_at_once():
    """An engine process still building reads no command: stop() (Ctrl-C during the load) kills it
    at once instead of waiting out the stop's deadline for an answer."""
    from helpers import slow_build
    from pagedcli.errors import RunError
    from pagedcli.serve.engine_client import STOP_S, EngineClient
    from pagedcli.serve.metrics import Metrics

    client = EngineClient(slow_build, (60.0,), Metrics())
    failed = []

    def start():
        try:
            client.start()
        except RunError as e:
            failed.append(str(e))

    starting = threading.Thread(target=start)
    starting.start()
    deadline = time.monotonic() + 30
    while (client.process is None or client.process.pid is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # (the engine process is building: sleeping in slow_build)
    began = time.perf_counter()
    client.stop()
    took = time.perf_counter() - began
    starting.join(10)
    assert not client.process.is_alive() and took < STOP_S / 2, f"stop took {took:.1f} s"
    assert failed and "ended while it built the engine" in failed[0]


def test_chat_logprobs_bytes_are_each_tokens_own_bytes():
    """A piece of a character (stories260K's byte fallback: 😀 is four `<0xNN>` pieces) is U+FFFD as
    text; its `bytes` are its own byte, so a client joins the pieces into the character."""
    from pagedcli.model.tokenizer import Tokenizer
    from pagedcli.serve.responses import Shapes

    class Logprob:
        def __init__(self, logprob, top):
            self.logprob, self.top = logprob, top

    tok = Tokenizer(ASSETS / "stories260K")
    pieces = tok.tok.encode("\U0001F600", add_special_tokens=False).ids[-4:]
    shapes = Shapes(True, "chatcmpl-1", "stories", lambda t: tok.decode([t], skip_special_tokens=False), True,
                    tok.token_bytes)
    content = shapes.logprobs(0, [(t, Logprob(-1.0, [(t, -1.0)])) for t in pieces])["content"]
    assert [e["token"] for e in content] == ["\ufffd"] * 4
    assert bytes(b for e in content for b in e["bytes"]).decode() == "\U0001F600"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_chunk_is_the_json_of_openais_chunk_object(chat):
    """Shapes.chunk writes its JSON by hand: it must parse to OpenAI's chunk, text with quotes,
    newlines and non-ASCII, a finish reason, log-probabilities and each kind of usage field."""
    from pagedcli.serve.engine_client import Delta
    from pagedcli.serve.responses import NO_USAGE, Shapes

    class Logprob:
        def __init__(self, logprob, top):
            self.logprob, self.top = logprob, top

    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-1", "object": kind, "model": 'a "model"\u2028é'}
    token_text = lambda t: f"<{t}\u2029>"  # noqa: E731
    for want_logprobs in (False, True):
        shapes = Shapes(chat, "cmpl-1", head["model"], token_text, want_logprobs)
        twin = Shapes(chat, "cmpl-1", head["model"], token_text, want_logprobs)  # (offsets: its own)
        for first, text, finish, usage in ((True, 'say "hi"\n\u00e9\u2028\x85\u2029', None, NO_USAGE),
                                           (False, "", "stop", None),
                                           (False, "x", "length", {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5})):
            delta = Delta(1, [7, 8], text, [Logprob(-0.5, [(7, -0.5)]), Logprob(float("-inf"), [(9, -1.0)])], finish)
            event = shapes.chunk(delta, first, usage)
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert event.decode().splitlines() == [event.decode()[:-2], ""]  # one line, for a client that splits so
            got = json.loads(event[6:])
            logprobs = twin.logprobs(1, list(zip(delta.token_ids, delta.logprobs))) if want_logprobs else None
            choice = {"index": 1, "finish_reason": finish, "logprobs": logprobs}
            if chat:
                role = {"role": "assistant"} if first else {}
                choice["delta"] = role | ({"content": text} if text or first else {})
            else:
                choice["text"] = text
            want = head | {"created": shapes.created, "choices": [choice]}
            if usage is not NO_USAGE:
                want["usage"] = usage
            assert got == want
