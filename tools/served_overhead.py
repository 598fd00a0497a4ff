#!/usr/bin/env python
"""The served path's own cost, without a GPU: `pagedcli bench` in-process against `pagedcli serve`
and a lean client, with the network replaced by a clock, so that only the host's work differs.

    python tools/served_overhead.py --step-ms 1.7 --num-prompts 512

Every decode step "computes" for --step-ms and a prefill step for --prefill-us a token, as a GPU's
queue would: busy from the end of the step before, the host's work between two steps overlapping
it (the engine's overlap on a GPU). Everything else is real: the engine, its process, the pipes,
the API process, uvicorn. The client is raw HTTP on one socket a stream (httpx's parsing of each
chunk would take a core of the two a CI machine has:
docs/performance-log.md, "The host's own work"); it counts time from its first request to the last
stream's end. Prints both runs' tokens/s, the served run's TTFT, and the CPU seconds the API and the
engine processes used during it (Linux). A --step-ms at which served falls short of in-process is
where the served path, not the "GPU", sets the pace (docs/serve.md has this machine's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the pagedcli of this checkout, installed or not
STEP_ENV, PREFILL_ENV = "SERVED_OVERHEAD_STEP_MS", "SERVED_OVERHEAD_PREFILL_US"


def replace_the_network() -> None:
    """ModelRunner.execute becomes a clock (greedy tokens that never stop: the answers run to max_tokens)."""
    import torch

    from pagedcli.engine import runner

    step_s, prefill_s = float(os.environ[STEP_ENV]) / 1e3, float(os.environ[PREFILL_ENV]) / 1e6
    done = [0.0]  # when the "GPU" finished the step before

    def execute(self, seqs, is_prefill, feed=None, num_new=None):
        new = num_new or [len(s) - s.num_cached for s in seqs]
        cost = 0.0002 + prefill_s * sum(new) if is_prefill else step_s
        # the step began when the one before ended, or (the host slower) when the host queued it
        done[0] = max(done[0], time.perf_counter() - cost) + cost
        while (left := done[0] - time.perf_counter()) > 0:
            time.sleep(max(0.0, left - 50e-6))
        rows = sum(s.num_cached + n >= len(s) for s, n in zip(seqs, new)) if is_prefill else len(seqs)
        vocab = self.model.config.vocab_size
        return torch.zeros(rows, 1), (torch.arange(rows, dtype=torch.int64) * 7 + 11) % (vocab - 300) + 256

    runner.ModelRunner.execute = execute


if STEP_ENV in os.environ:  # this process, or the engine process that spawn started from this file
    replace_the_network()


# --- the client ----------------------------------------------------------------------------------
async def stream(reader, writer, body: bytes) -> tuple[float, float | None, float]:
    """One streamed completion on a kept-alive connection: when it was sent, its first token came, it ended."""
    start = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    first, tail = None, b""
    while data := await reader.read(65536):
        first = first or (time.perf_counter() if b"data: {" in tail + data else None)
        tail = (tail + data)[-64:]
        if tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the last event, then the chunked body's end
            break
    return start, first, time.perf_counter()


async def clients(port: int, bodies: list[bytes], concurrency: int) -> dict:
    """`bodies` sent over `concurrency` connections, opened before the clock starts, a request at a time each."""
    queue = list(reversed(bodies))
    results = []
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]

    async def worker(reader, writer):
        while queue:
            results.append(await stream(reader, writer, queue.pop()))
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker(*c) for c in connections))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "ttft_ms_p50": statistics.median((f - s) * 1e3 for s, f, _ in results if f)}


def run_async(coroutine):
    try:  # the cheaper loop where it is installed (the serve extra brings it), as the server's
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


# --- the runs ------------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """`pid`'s spawned children, oldest first: the engine's process, then the other API processes
    (multiprocessing's resource tracker left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid and \
                    b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass
    return sorted(found)


def served(args, env: dict) -> dict:
    said = tempfile.TemporaryFile()  # the server's stderr (a pipe nobody reads would fill and stop it)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--role", "serve", "--model", args.model,
                               "--batch", str(args.batch), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                               "--api-server-count", str(args.api_server_count), "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=said)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    said.seek(0)
                    why = (said.read().decode(errors="replace").strip().splitlines() or ["(it said nothing)"])[-1]
                    raise SystemExit(f"the server did not start: {why}")
                time.sleep(0.2)
        rng = random.Random(0)

        def body(max_tokens: int) -> bytes:
            return json.dumps({"model": args.model, "prompt": [rng.randrange(5, 400) for _ in range(args.input_len)],
                               "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                               "ignore_eos": True}).encode()

        run_async(clients(port, [body(4) for _ in range(4)], 4))  # warm-up (and the engine has started)
        engine, *others = children(server.pid)
        apis = [server.pid, *others]
        api0, engine0 = sum(map(cpu_s, apis)), cpu_s(engine)
        result = run_async(clients(port, [body(args.output_len) for _ in range(args.num_prompts)], args.batch))
        result |= {"api_cpu_s": sum(map(cpu_s, apis)) - api0, "engine_cpu_s": cpu_s(engine) - engine0}
        result["output_tokens_per_s"] = args.num_prompts * args.output_len / result["elapsed_s"]
        return result
    finally:
        server.terminate()
        server.wait(30)
        said.close()


def in_process(args, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--role", "bench", "--model", args.model, "--batch", str(args.batch),
                          "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                          "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                          "--output-len", str(args.output_len), "--json"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--role":  # a child: the command with the clock for a network
        from pagedcli.commands.app import main as pagedcli

        sys.argv = ["pagedcli", sys.argv[2], *sys.argv[3:]]
        pagedcli()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=1.7, help="a decode step's time (default 1.7: batch 64 on an H200)")
    p.add_argument("--prefill-us", type=float, default=4.0, help="a prefill step's time a token (default 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="a step's tokens, the same in both runs (default 8192)")
    p.add_argument("--api-server-count", type=int, default=1, help="the server's API processes (default 1)")
    p.add_argument("--model", default="demo")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args()
    # this checkout first, and whatever the environment's path held (the serve extra may live there)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {STEP_ENV: str(args.step_ms), PREFILL_ENV: str(args.prefill_us), "PYTHONPATH": path}
    alone = in_process(args, env)["output_tokens_per_s"]
    s = served(args, env)
    print(f"clock: {args.step_ms} ms a decode step; {args.num_prompts} prompts of {args.input_len} + {args.output_len} "
          f"tokens, {args.batch} at once")
    print(f"in-process {alone:,.0f} tok/s; served {s['output_tokens_per_s']:,.0f} tok/s "
          f"({s['output_tokens_per_s'] / alone:.0%}), TTFT p50 {s['ttft_ms_p50']:.1f} ms; CPU during the served run: "
          f"API process{'es' if args.api_server_count > 1 else ''} {s['api_cpu_s']:.2f} s, engine process {s['engine_cpu_s']:.2f} s of {s['elapsed_s']:.2f} s")


if __name__ == "__main__":
    main()
