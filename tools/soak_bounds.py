#!/usr/bin/env python
"""The server's load cases of issue 51, bounded (a minute or two on a CPU): a `pagedcli serve` of the
built-in model on a free loopback port, and

  1. a stop-string flood: a neighbour's inter-token gap (ITL) alone, beside 7 plain streams, and
     beside 7 streams that each ask for the most stop strings of the longest length the server
     takes (none ever found); and the request that asked for 100,000 of them, refused;
  2. large bodies against the API process's memory: its RSS before, its peak (VmHWM) and RSS after
     a body over --max-request-size (413, said by Content-Length, the body never sent), a body at
     the limit of token-id prompts (parsed and validated whole, refused at its last prompt), a text
     prompt past any tokenization of the model's length, and a million short prompts;
  3. the engine process stopped (SIGSTOP) under a stream: /health's status meanwhile, the time
     until it says 503, the stream's ending, a new request's status, and /health after SIGCONT.

    python tools/soak_bounds.py [--json]

Loopback only (127.0.0.1). The figures are this machine's: compare the ratios, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the pagedcli of this checkout, installed or not
from pagedcli.core.options import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402

ENGINE_TIMEOUT_S = 5.0  # the server's --engine-timeout here (its default is 60 s)
BATCH = 8


def start_server(model: str, *args: str):
    proc = subprocess.Popen([sys.executable, "-m", "pagedcli", "serve", "--model", model, "--device", "cpu",
                             "--host", "127.0.0.1", "--port", "0", "--batch", str(BATCH), *args],
                            cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server ended before it served")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # (its log: drained)
    return proc, re.search(r"at (http://\S+)/v1", line).group(1)


def engine_pid(api_pid: int) -> int:
    """The engine process the server started (spawned; not multiprocessing's resource tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == api_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise SystemExit("no engine process")


def memory(pid: int) -> dict:
    """The process's resident memory now and at its peak, in MiB (/proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1)) for k in ("VmRSS", "VmHWM")}
    return {"rss_mib": round(kib["VmRSS"] / 1024, 1), "peak_mib": round(kib["VmHWM"] / 1024, 1)}


def reset_peak(pid: int) -> None:
    """VmHWM back to the current RSS (Linux 4.0+: writing 5 to clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


# --- 1. the stop-string flood ------------------------------------------------------------------
def stream_gaps(httpx, url: str, body: dict, started: threading.Event | None = None) -> list[float]:
    """A streamed completion's gaps between chunks (seconds), from its second chunk on."""
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if started is not None and len(times) == 2:
                    started.set()
    return [b - a for a, b in zip(times[1:], times[2:])]


def neighbour_itl(httpx, url: str, others: list[dict]) -> float:
    """The median gap of a 150-token stream, with `others` streaming beside it the whole time."""
    neighbour = {"prompt": "ROMEO:", "max_tokens": 150, "ignore_eos": True}
    running = []
    for body in others:  # started first, and already streaming when the neighbour starts
        ready = threading.Event()
        t = threading.Thread(target=stream_gaps, args=(httpx, url, body, ready), daemon=True)
        t.start()
        running.append((t, ready))
    for _, ready in running:
        ready.wait(120)
    gaps = stream_gaps(httpx, url, neighbour)
    for t, _ in running:
        t.join(600)
    return statistics.median(gaps)


def stop_flood(httpx, url: str) -> dict:
    long_stops = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]  # never in the demo's text
    plain = {"prompt": "JULIET:", "max_tokens": 400, "ignore_eos": True}
    flood = plain | {"stop": long_stops}
    solo = neighbour_itl(httpx, url, [])
    beside_plain = neighbour_itl(httpx, url, [plain] * (BATCH - 1))
    beside_flood = neighbour_itl(httpx, url, [flood] * (BATCH - 1))
    refused = httpx.post(url + "/v1/completions", timeout=600,
                         json={"prompt": "ROMEO:", "stop": [f"s{i}" for i in range(100_000)]})
    return {"neighbour_itl_ms_solo": round(1e3 * solo, 2), "neighbour_itl_ms_beside_7_plain": round(1e3 * beside_plain, 2),
            "neighbour_itl_ms_beside_7_floods": round(1e3 * beside_flood, 2),
            "flood_over_plain": round(beside_flood / beside_plain, 2), "flood_over_solo": round(beside_flood / solo, 2),
            "stops_per_flood_request": f"{MAX_STOP_STRINGS} x {MAX_STOP_CHARS} characters",
            "100000_stops": f"HTTP {refused.status_code}: {refused.json()['error']['message'][:60]}"}


# --- 2. large bodies ---------------------------------------------------------------------------
def said_too_large(url: str, size: int) -> str:
    """POST a body of `size` bytes by its Content-Length, sending only the headers: the status line."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {size}\r\n\r\n".encode())
        return s.recv(4096).split(b"\r\n", 1)[0].decode()


def large_bodies(httpx, url: str, api_pid: int, limit: int) -> dict:
    out = {"limit_mib": limit / 2**20, "before": memory(api_pid)}
    # prompts of 480 token ids, as many as the limit holds; the last one's last id is outside the
    # vocabulary: refused after the whole body is read and validated
    prompt = [100 + (7 * j) % 400 for j in range(480)]
    n = min(4000, (limit - 100) // (len(json.dumps(prompt)) + 2))
    ids = [prompt] * (n - 1) + [prompt[:-1] + [10**6]]
    cases = {
        "50 MiB, said by Content-Length (413)": lambda: said_too_large(url, 50 << 20),
        "token ids at the limit (400 at the last prompt)": lambda: json.dumps({"prompt": ids, "max_tokens": 1}),
        "one text prompt at the limit (400 before tokenizing)": lambda: json.dumps({"prompt": "hello " * (limit // 6 - 10)}),
        "a million short prompts (400 before validating)": lambda: json.dumps({"prompt": ["hi"] * 1_000_000}),
    }
    for name, make in cases.items():
        reset_peak(api_pid)
        body = make()
        if name.startswith("50 MiB"):
            status = body
        else:
            r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=600)
            status = f"HTTP {r.status_code} ({len(body) / 2**20:.1f} MiB): {r.json()['error']['message'][:70]}"
        time.sleep(0.5)
        out[name] = {"status": status, **memory(api_pid)}
    return out


# --- 3. the engine stopped ---------------------------------------------------------------------
def stopped_engine(httpx, url: str, pid: int) -> dict:
    out = {"engine_timeout_s": ENGINE_TIMEOUT_S, "health_before": httpx.get(url + "/health").status_code}
    body = {"prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    statuses, ending = [], []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()

            def watch():
                while time.monotonic() - stopped < 4 * ENGINE_TIMEOUT_S:
                    status = httpx.get(url + "/health", timeout=30).status_code
                    statuses.append((round(time.monotonic() - stopped, 1), status))
                    if status == 503:
                        return
                    time.sleep(0.1)

            watcher = threading.Thread(target=watch)
            watcher.start()
            ending = [x for x in lines if x.startswith("data: ")][-2:]
            out["stream_ended_after_s"] = round(time.monotonic() - stopped, 1)
            watcher.join()
        out["health_while_stopped"] = sorted({s for _, s in statuses})
        out["time_to_503_s"] = next((t for t, s in statuses if s == 503), None)
        out["stream_ending"] = [e[:90] for e in ending]
        r = httpx.post(url + "/v1/completions", json=body | {"stream": False}, timeout=60)
        out["new_request_while_stopped"] = f"HTTP {r.status_code}"
    finally:
        os.kill(pid, signal.SIGCONT)
    continued = time.monotonic()
    while httpx.get(url + "/health").status_code != 200 and time.monotonic() - continued < 60:
        time.sleep(0.1)
    out["health_after_SIGCONT"] = httpx.get(url + "/health").status_code
    out["back_after_s"] = round(time.monotonic() - continued, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="the figures as one JSON object")
    p.add_argument("--model", default="demo", help="the model served (default: the built-in one); for the large "
                   "bodies, one with a long --max-model-len tokenizes what the demo's 512 tokens refuse")
    p.add_argument("--serve-args", default="", help="more of serve's options, e.g. '--cache-size 1GiB'")
    p.add_argument("--only", choices=("stop_flood", "large_bodies", "stopped_engine"), action="append",
                   help="run only this part (repeatable)")
    a = p.parse_args(argv)
    import httpx

    from pagedcli.serve import DEFAULT_MAX_BODY_BYTES

    proc, url = start_server(a.model, "--engine-timeout", str(ENGINE_TIMEOUT_S), *a.serve_args.split())
    parts = {"stop_flood": lambda: stop_flood(httpx, url),
             "large_bodies": lambda: large_bodies(httpx, url, proc.pid, DEFAULT_MAX_BODY_BYTES),
             "stopped_engine": lambda: stopped_engine(httpx, url, engine_pid(proc.pid))}
    try:
        figures = {name: run() for name, run in parts.items() if not a.only or name in a.only}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if a.json:
        print(json.dumps(figures))
    else:
        for part, values in figures.items():
            print(part)
            for k, v in values.items():
                print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
