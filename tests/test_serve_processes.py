"""`pagedcli serve`'s processes: the engine in its own process (its failures and its death as 500s,
503s and error events, its links to several API processes, the command pipe into it, a stop while
it builds), the command run as a subprocess with one API process or two, and how each stops:
Ctrl-C once and twice, SIGTERM, a hang-up, a kill, the first API process dying, a log reader gone;
every process ends, no traceback, exit 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import check_block_accounting, engine_process_of, start_server  # noqa: E402
from serve_fixtures import served, uvicorn_error_records  # noqa: E402


# --- the engine's process ---------------------------------------------------------------------
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


def test_an_engine_process_serves_each_link_its_own_and_outlives_one_gone(make_engine):
    """Two API processes' links into one engine process: the same request key on both is two
    requests, each link's messages carry its own answer only; a link whose process is gone (its
    pipe closed) has its request aborted, and the other's runs to its end; the last stop ends it."""
    import multiprocessing

    from pagedcli.core.options import SamplingParams
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
        kind, *rest = messages.recv()
        while kind == "beat":  # (an idle engine's heartbeat: it says nothing else)
            kind, *rest = messages.recv()
        assert kind == "step"
        tokens, deltas, _report = rest
        triples = iter(tokens)
        got = [t for key, index, t in zip(triples, triples, triples) if (key, index) == (1, 0)]
        ended = None
        for key, index, token_ids, _text, _logprobs, finish, *_ in deltas:
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
    from pagedcli.core.errors import RunError
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


# --- signals and shutdown ---------------------------------------------------------------------
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


# --- two API processes ------------------------------------------------------------------------
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
