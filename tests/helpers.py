"""Test helpers: the transformers oracle, block-accounting checks, and the CLI run in-process."""

from __future__ import annotations

import time
import types
from collections import Counter

import numpy as np
import torch

# The pool of a test's engine where the test does not size it. The CPU default (256 MiB) is zeroed
# at every load: 65536 blocks of the tiny model where a test's requests take a few hundred; 32 MiB
# holds the demo model's 8 slots at full length.
TEST_CACHE_SIZE = "32MiB"


def invoke(*args) -> tuple[int, str, str]:
    """`pagedcli *args` in-process: (exit code, stdout, stderr). An exception the CLI did not turn
    into a clean exit is raised again, so that the test shows its traceback."""
    from typer.testing import CliRunner

    from pagedcli.commands.app import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code == 1 and result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def fake_gpu(monkeypatch, name: str, memory: int) -> None:
    """torch.cuda.get_device_properties answers for this GPU (the default step budget asks it;
    no GPU needed)."""
    props = types.SimpleNamespace(name=name, total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def hf_model(folder, dtype=torch.float32, device="cpu"):
    """transformers' own class for the checkpoint (LlamaForCausalLM, Qwen2ForCausalLM, ...)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int, device="cpu"):
    """Greedy tokens and each step's logits, recomputing the whole sequence every step: the
    simplest possible reference, with no cache of any kind."""
    seq, tokens, logits = list(prompt), [], []
    for _ in range(steps):
        out = model(torch.tensor([seq], device=device)).logits[0, -1].float()
        logits.append(out)
        tokens.append(int(out.argmax()))
        seq.append(tokens[-1])
    return tokens, logits


def record_logits(engine):
    """Wrap the runner so each step's logits are kept per sequence id: {id: [logits, ...]}."""
    seen: dict[int, list[torch.Tensor]] = {}
    run = engine.runner.execute

    def recording(seqs, is_prefill, feed=None, num_new=None):
        logits, greedy = run(seqs, is_prefill, feed, num_new)
        if num_new is not None:  # rows whose prompt chunk stops short sample nothing: no logits
            seqs = [s for s, n in zip(seqs, num_new) if s.num_cached + n == len(s)]
        for seq, row in zip(seqs, logits):
            seen.setdefault(seq.id, []).append(row.clone())
        return logits, greedy

    engine.runner.execute = recording
    return seen


def check_block_accounting(engine) -> None:
    """Each block is free or owned: a free block has no owner and no table entry; an owned block's
    reference count equals the table entries that point at it, all of one layer and one logical
    position (sharing is between sequences, never between layers or positions); the table never
    points at a free block; free + owned = total."""
    cache = engine.cache
    # numpy over the free list, not Python over each block: a CPU pool has tens of thousands, and
    # this runs after every step of many tests
    free = np.asarray(cache.allocator.free, dtype=np.int64)  # (a walk over the linked list)
    assert len(free) == cache.allocator.num_free, "the free list's length is not its count"
    in_free = np.bincount(free, minlength=cache.geometry.num_blocks)
    assert in_free.max(initial=0) <= 1, "a block is in the free list twice"
    refs: Counter = Counter()
    where: dict[int, set] = {}
    for slot in range(cache.max_slots):
        n, slid = cache.num_blocks_of_slot[slot], cache.num_slid[slot]
        assert (cache.table[slot, :, n:] == -1).all(), "table entries past the slot's blocks"
        assert (cache.table[slot, :, :slid] == -1).all(), "a block behind the sliding window is still held"
        assert (cache.table[slot, :, slid:n] >= 0).all(), "a block within the window was given back"
        for layer in range(cache.geometry.num_layers):
            for logical, b in enumerate(cache.table[slot, layer, slid:n].tolist(), start=slid):
                refs[b] += 1
                where.setdefault(b, set()).add((layer, logical))
    assert not any(in_free[b] for b in refs), "the table points at a free block"
    for b, count in refs.items():
        assert cache.allocator.ref_count[b] == count, f"block {b}: {count} owners, ref count {cache.allocator.ref_count[b]}"
        assert len(where[b]) == 1, f"block {b} holds two different things: {where[b]}"
    assert not cache.allocator.ref_count[free].any(), "a free block has owners"
    assert len(refs) + len(free) == cache.geometry.num_blocks
    running_slots = {s.slot for s in engine.scheduler.running}
    for slot in range(cache.max_slots):
        if slot not in running_slots:
            assert cache.num_blocks_of_slot[slot] == 0, f"slot {slot} holds blocks but runs nothing"


def assert_one_line(code, stderr, expected_code, *fragments):
    """A clean failure: the exit code, one `error:` line holding each fragment, no traceback."""
    assert code == expected_code, stderr
    assert "Traceback" not in stderr
    assert len([line for line in stderr.strip().splitlines() if line.startswith("error:")]) == 1, stderr
    for f in fragments:
        assert f in stderr, stderr


def run_greedy(loaded, prompt_list, steps):
    """Greedy answers of all prompts in one engine, block accounting checked after every step, the
    pool whole at the end: [(tokens, [logits of each step])] in prompt order."""
    from pagedcli.core.options import SamplingParams

    engine = loaded.engine
    logits = record_logits(engine)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in prompt_list]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    return [(seq.output_token_ids, logits[seq.id]) for seq in seqs]


def blocks_of(cache, slot: int, layer: int) -> list[int]:
    """The physical blocks `slot` holds in `layer`, in logical order."""
    return cache.table[slot, layer, : cache.num_blocks_of_slot[slot]].tolist()


def start_server(*args):
    """`pagedcli serve --model demo --device cpu --port 0 ARGS...` as a process (in a process group of
    its own, as a terminal starts it), and the URL it says it serves (http://127.0.0.1:PORT/v1),
    once it does. The caller stops it (and reads its stderr, or the access log fills the pipe)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-m", "pagedcli", "serve", "--model", "demo", "--device", "cpu",
                             "--port", "0", *args], cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own process group, for a terminal's Ctrl-C
    line = ""
    proc.start_lines = []  # what it said up to its serving line
    while "serving" not in line:
        line = proc.stderr.readline()
        proc.start_lines.append(line)
        if not line:
            proc.kill()
            raise AssertionError("the server ended before it served")
    return proc, re.search(r"at (http://\S+/v1)", line).group(1)


def engine_process_of(pid: int) -> int:
    """The pid of the engine process `pagedcli serve` (process `pid`) started."""
    from pathlib import Path

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # (it ended meanwhile)
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"process {pid} has no engine process")


def serve_build(model: str, batch: int, engine: dict, template: str | None, poison: bool = False):
    """The engine of a test's server (run in its engine process: a module-level function, which
    spawn pickles by name). `poison`: a bug on demand, from the prompt: "POISON" fails its adding,
    "CRASH" the step that runs it."""
    from pagedcli.engine.build import load
    from pagedcli.core.options import EngineOptions

    sized = engine if "num_blocks" in engine else {"cache_size": TEST_CACHE_SIZE} | engine
    loaded = load(EngineOptions(model=model, device="cpu", batch=batch, shuffle_blocks=7, **sized))
    if loaded.tokenizer is not None and template is not None:
        loaded.tokenizer.use_chat_template(template)
    if poison:
        engine = loaded.engine
        add, step = engine.add_request, engine.step

        def add_request(ids, params, text=None):
            if text == "POISON":
                raise RuntimeError("a bug in adding")
            return add(ids, params, text)

        def failing_step():
            if any(s.prompt == "CRASH" for s in engine.scheduler.running):
                raise RuntimeError("a bug in the step")
            return step()

        engine.add_request, engine.step = add_request, failing_step
    return loaded


def slow_build(seconds: float):
    """An engine process's build that takes `seconds` (module-level: spawn pickles it by name)."""
    time.sleep(seconds)
    raise RuntimeError("a slow build's end")


# --- the CUDA backend's kernels (GPU tests) ---------------------------------------------------

def spy_launches(be) -> list[str]:
    """The names of the kernels `be` launches from now on, in order."""
    launched, launch = [], be.launch

    def spy(kernel, *args, **kwargs):
        launched.append(kernel)
        return launch(kernel, *args, **kwargs)
    be.launch = spy
    return launched


def use_rope_width(monkeypatch, width: str) -> None:
    """rope_write_kv's 16-byte-vector kernel at any grid ("vectors", where the geometry allows it),
    or its one-element kernel ("elements")."""
    monkeypatch.setattr("pagedcli.backends.cuda.ROPE_VEC_MIN_CTAS_PER_SM", 0 if width == "vectors" else 10**9)


def rope_kernel(s, width: str) -> str:
    """The RoPE + K/V write kernel a test's rows get under use_rope_width(width):
    the vector one wherever half a head is whole 16-byte vectors (the test's q, k, v are aligned
    column slices of one fused tensor)."""
    vectors = width == "vectors" and s.config.head_dim // 2 % s.cuda.vec == 0
    return "rope_write_kv_vec" if vectors else "rope_write_kv_scalar"
