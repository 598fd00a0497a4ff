"""`pagedcli serve` under load: many clients at once (each answer its solo run's, every block back),
a long text tokenized off the event loop while other requests go on, clients that go away
(mid-stream, before their first token, while they wait, before their body came whole), what waits
and what is refused (--max-waiting: 400 and 429), and the engine's abort of a request wherever it
is. The real server (serve_fixtures.Served) on a free loopback port, the built-in model."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import check_block_accounting  # noqa: E402
from serve_fixtures import PROMPTS, one_slot_fixture, served, server_fixture, uvicorn_error_records  # noqa: E402

server = server_fixture()
one_slot = one_slot_fixture()


# --- many clients -----------------------------------------------------------------------------
def test_32_concurrent_streams_each_answer_its_solo_run_and_every_block_comes_back(make_engine):
    from pagedcli.core.options import SamplingParams
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


def test_a_long_text_is_tokenized_off_the_event_loop_while_other_requests_go_on(server, monkeypatch):
    """It was tokenized on the event loop: a 10 MB prompt stalled every stream for 5 s. Here the
    tokenizer holds the long text until a small request has its answer (a wait lets go of the GIL,
    as its encode_batch does): on the event loop it would hold that answer back too, for the wait's
    whole 30 s, however fast the machine."""
    tokenizer = server.ready.tokenizer
    encode, threads = tokenizer.encode, []
    answered, waited_out = threading.Event(), []

    def slow_encode(text, *args, **kw):
        threads.append(threading.current_thread())
        if len(text) > 5_000:
            waited_out.append(not answered.wait(30))
        return encode(text, *args, **kw)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    # (prompts short enough in characters to be tokenized at all, app.py's longest_text; too long in tokens)
    big = threading.Thread(target=lambda: threads.append(httpx.post(server.url + "/v1/completions", timeout=60,
                                                                    json={"prompt": ["hello " * 1_400] * 9})))
    big.start()
    while not threads:
        time.sleep(0.01)
    small = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=60)
    answered.set()
    big.join()
    assert small.status_code == 200 and True not in waited_out, "the small request waited for the big one"
    assert threads[0] is not server.thread, "the big body was tokenized on the event loop's thread"
    assert threads[-1].status_code == 400 and "the prompt has 2,803 tokens" in threads[-1].json()["error"]["message"]


# --- clients that go away ---------------------------------------------------------------------
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
    from pagedcli.core.options import SamplingParams
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


# --- what waits and what is refused -----------------------------------------------------------
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


# --- the engine's abort -----------------------------------------------------------------------
def test_abort_ends_one_request_wherever_it_is_and_the_others_go_on(make_engine):
    from pagedcli.core.options import SamplingParams

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


def test_abort_with_a_decode_step_queued_ahead(tiny, make_engine):
    """The overlap (forced on, as on a GPU): the step queued ahead still holds the aborted row,
    which the next step drops; the others' tokens are those of a run without either."""
    from pagedcli.core.options import SamplingParams

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
