"""Tensor parallelism (`--tensor-parallel-size N`, `-tp N`) on the CPU: N ranks, each holding a share
of every layer's heads and columns and of every KV block's heads, give what one rank gives. Greedy
tokens identical and logits within fp32 rounding at world 2 and 4 (KV heads replicated where they are
fewer than the ranks), for the demo model and 2-layer cuts of the Llama-3, Qwen2 (q/k/v biases), Qwen3
(q/k norms) and Mistral (a sliding window crossed many times) presets; through prefix-cache hits,
chunked prefill and preemption, with rank 0's block accounting checked at every step and each rank's
pool holding exactly its heads of the blocks one rank's pool holds. Wrong sizes are one line. Through
the real command: `-tp 2` prints what one rank prints, a killed worker ends the run with one line and
exit code 1, a killed rank 0 leaves no worker behind, and `serve -tp 2` answers as one rank does.

Most tests run the ranks as threads of the test's process (a gloo group over an in-memory store:
no processes to start); the command-line ones start the real worker processes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_one_line, check_block_accounting, invoke, record_logits, start_server
from test_oracle import prompts

from pagedcli.core.errors import UsageError
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.core.parallel import TensorParallelGroup
from pagedcli.engine import build
from pagedcli.engine.ranks import follow
from pagedcli.model.config import ModelConfig
from pagedcli.model.presets import RANDOM_PRESETS
from pagedcli.model.sharding import check_divides, kv_heads_of

REPO = Path(__file__).resolve().parents[1]
PAGEDCLI = [sys.executable, "-m", "pagedcli"]
DEMO_VOCAB = 2048
COLLECTIVE_TIMEOUT = timedelta(seconds=20)  # a rank that stops answering fails the others' collectives
RANKS_DEADLINE_S = 120.0  # every thread rank of one run ends within this, or the test fails
_groups = itertools.count()


# --- ranks as threads ----------------------------------------------------------------------------
def at_world(world: int, opts: EngineOptions, body):
    """`body(engine)` run on rank 0 of `world` ranks (threads of this process, each with its gloo
    group over a HashStore of its own); ranks 1 and up follow rank 0's plans until it sends stop,
    which it does whatever `body` did. (world 1: no group, the engine alone.) Returns (what `body`
    returned, {rank: its ModelRunner}). The first exception of any rank is raised here; a rank still
    running at the deadline fails the test rather than hanging it."""
    opts = replace(opts, tensor_parallel_size=world)
    runners: dict[int, object] = {}
    build_runner = build.build_runner

    def recording_build_runner(model, *args, **kwargs):  # (rank 0's build_engine and the followers' `follow`)
        runner = build_runner(model, *args, **kwargs)
        runners[model.tp.rank if model.tp is not None else 0] = runner
        return runner

    build.build_runner = recording_build_runner
    try:
        if world == 1:
            return body(build.build_engine(build.load_model(opts), opts)), runners
        return _thread_ranks(world, opts, body), runners
    finally:
        build.build_runner = build_runner


def _thread_ranks(world: int, opts: EngineOptions, body):
    store, name = dist.HashStore(), f"tp-test-{next(_groups)}"
    results, errors = {}, {}

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, COLLECTIVE_TIMEOUT)
            tp = TensorParallelGroup(rank, world, group)
            if rank > 0:
                follow(build.load_model(opts, tp=tp), tp)
                return
            try:
                results[0] = body(build.build_engine(build.load_model(opts, tp=tp), opts))
            finally:
                tp.send(("stop",))
        except BaseException as e:  # noqa: BLE001 (raised again in the test's thread)
            errors[rank] = (time.monotonic(), e)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"tp-rank-{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + RANKS_DEADLINE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if errors:  # the first to fail: a follower's own error, not rank 0's broken collective after it
        raise min(errors.values(), key=lambda e: e[0])[1]
    assert not hung, f"{hung} still running {RANKS_DEADLINE_S:.0f} s on: rank 0's stop never reached them"
    return results[0]


@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]
    steps: list
    engine: object


def greedy(prompt_list, steps: int, queued=()):
    """A body for at_world: every prompt added at once, greedy, `steps` tokens each; then each of
    `queued` added once the first ones are done (prefix-cache hits on what they left). Rank 0's block
    accounting is checked after every step and the pool is whole at the end."""
    def body(engine):
        logits = record_logits(engine)
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        seqs, outs = [], []
        for batch in (prompt_list, queued):
            seqs += [engine.add_request(p, params) for p in batch]
            while engine.has_unfinished:
                outs.append(engine.step())
                check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks, "a block leaked"
        return Run([s.output_token_ids for s in seqs], [logits[s.id] for s in seqs], outs, engine)
    return body


def assert_same_as_one_rank(world: int, opts: EngineOptions, body) -> tuple[Run, Run, dict]:
    """`body` at `world` ranks and at one: tokens identical, logits within fp32 rounding (the ranks'
    partial sums add in another order), and each rank's pool holding what one rank's pool holds at
    that rank's KV heads, block for block (the same blocks handed out, the same K and V written into
    them: the other ranks' tables follow rank 0's, copies included). Returns (tp run, one rank's run,
    the tp runners)."""
    one, one_runners = at_world(1, opts, body)
    many, runners = at_world(world, opts, body)
    assert many.tokens == one.tokens
    scale = max(1.0, max(l.abs().max().item() for ls in one.logits for l in ls))
    diff = max((a - b).abs().max().item() for la, lb in zip(many.logits, one.logits) for a, b in zip(la, lb))
    assert diff < 1e-4 * scale, f"logits differ by {diff} (scale {scale:.1f})"
    whole = one_runners[0].cache.store.pool
    assert sorted(runners) == list(range(world))
    config = opts_config(opts)
    for rank, runner in runners.items():
        first, stop = kv_heads_of(config, world, rank)
        mine = runner.cache.store.pool
        assert mine.shape == whole[:, :, :, first:stop].shape, (rank, mine.shape, whole.shape)
        gap = (mine - whole[:, :, :, first:stop]).abs().max().item()
        assert gap < 1e-4 * max(1.0, whole.abs().max().item()), f"rank {rank}'s pool is off by {gap}"
    return many, one, runners


def opts_config(opts: EngineOptions) -> ModelConfig:
    from pagedcli.model.source import resolve_model

    return resolve_model(opts.model).config


def demo_opts(**kw) -> EngineOptions:
    kw = {"model": "demo", "device": "cpu", "dtype": "float32", "threads": 1, "shuffle_blocks": 1234,
          "num_blocks": 5 * 48, "batch": 3} | kw  # 5 layers: 48 blocks of 16 tokens a layer
    return EngineOptions(**kw)


# --- the demo model ------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_demo_greedy_at_world_2_and_4_is_one_ranks(world):
    """Prompts of 1 to 40 tokens, 5 of them through 3 slots (refills), 16 greedy tokens each: a rank
    that took the wrong rows of q/k/v or gate/up, the wrong columns of o or down, forgot an
    all-reduce, or gathered the LM head's vocabulary shares out of order would give other logits and
    tokens. At world 4 the demo's 2 KV heads are replicated (ranks 0-1 and 2-3 share one): a rank
    reading the other KV head, or a pool sized for half a head, would show here."""
    prompt_list = prompts([1, 5, 17, 40, 9], DEMO_VOCAB, seed=1)
    many, one, _ = assert_same_as_one_rank(world, demo_opts(), greedy(prompt_list, 16))
    assert len({tuple(t) for t in one.tokens}) >= 3, "the prompts' answers differ from each other"
    assert max(len(s.seqs) for s in many.steps) == 3, "the batch held several sequences at once"


def test_each_rank_holds_its_kv_heads_and_its_share_of_the_pool():
    """`runner.ranks` (for the view and inspect-cache) names each rank's KV heads: at world 2 on the
    demo (2 KV heads) rank 0 holds (0, 1) and rank 1 (1, 2); each pool is one rank's pool halved for
    the same blocks, and is a pool of its own (not one shared buffer). Every rank's runner lists the
    same views (they are gathered on every rank)."""
    opts = demo_opts(num_blocks=5 * 8)
    one, one_runners = at_world(1, opts, lambda engine: engine.runner.cache.geometry.pool_bytes)
    views, runners = at_world(2, opts, lambda engine: engine.runner.ranks)
    assert [(v.rank, v.kv_heads) for v in views] == [(0, (0, 1)), (1, (1, 2))]
    assert all(v.device == "cpu" for v in views)
    assert [v.pool_bytes for v in views] == [one // 2, one // 2]
    assert views[0].pool_address != views[1].pool_address
    assert [(v.pool_address, v.pool_bytes) for v in views] == [
        (r.cache.store.pool.data_ptr(), r.cache.store.pool.numel() * r.cache.store.pool.element_size())
        for r in (runners[0], runners[1])]
    assert runners[1].ranks == views
    assert runners[0].cache.geometry.num_blocks == runners[1].cache.geometry.num_blocks == 5 * 8
    assert one_runners[0].ranks == (), "one rank lists no ranks"


# --- the families' geometries, cut small -----------------------------------------------------------
LLAMA3_VOCAB = 251  # odd: the last rank's vocabulary share is short (padded for the gather)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    """Llama-3.2-1B's geometry (32 heads, 8 KV heads, llama3 RoPE scaling) as `random:<folder>`
    (random weights made as each rank reads its share), and transformers checkpoints of Qwen2.5-0.5B
    (q/k/v biases, 14 heads over 2 KV heads), Qwen3-0.6B (q/k norms) and Mistral-7B (a window of 8),
    their norms and biases varied (test_families' checkpoints): 2 layers, a small hidden size."""
    from test_families import family_checkpoint

    folders = {}
    llama = json.loads(RANDOM_PRESETS["llama-3.2-1b"].read_text())
    llama |= {"hidden_size": 128, "intermediate_size": 96, "vocab_size": LLAMA3_VOCAB, "num_hidden_layers": 2,
              "max_position_embeddings": 512}
    folder = tmp_path_factory.mktemp("llama3")
    (folder / "config.json").write_text(json.dumps(llama))
    folders["llama-3.2-1b"] = f"random:{folder}"
    for preset in ("qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.1"):
        folders[preset] = str(family_checkpoint(tmp_path_factory.mktemp(preset), preset))
    return folders


@pytest.mark.parametrize("preset, world", [("llama-3.2-1b", 2), ("qwen2.5-0.5b", 2), ("qwen3-0.6b", 2),
                                           ("mistral-7b-v0.1", 2)])  # (world 4: the demo's test)
def test_family_geometries_at_several_ranks_are_one_ranks(family_folders, preset, world):
    """Each family's own tensors split with its heads: Qwen2's q/k/v biases must take the same rows
    as their weights, Qwen3's per-head q/k norms apply to each rank's heads, Mistral's window of 8
    is crossed many times (prompts of 3 to 45 tokens, 30 new tokens; blocks of 8 given back behind it
    on every rank alike); Llama-3's vocabulary of 251 does not divide among the ranks. Two prompts
    share 32 tokens (a prefix-cache hit), prompts go in chunks of 7 beside the decoding rows."""
    config = opts_config(EngineOptions(model=family_folders[preset]))
    check_divides(config, world)  # (the geometry is one the ranks can share: else the test says nothing)
    vocab = config.vocab_size
    shared = prompts([32], vocab, seed=9)[0]
    prompt_list = prompts([3, 45, 17], vocab, seed=5) + [shared + [7, 8]]
    opts = EngineOptions(model=family_folders[preset], device="cpu", dtype="float32", threads=1, shuffle_blocks=7,
                         batch=3, block_size=8, num_blocks=2 * 60, max_num_batched_tokens=7)
    many, one, _ = assert_same_as_one_rank(world, opts, greedy(prompt_list, 30, queued=[shared + [9]]))
    assert many.engine.scheduler.cached_prompt_tokens == one.engine.scheduler.cached_prompt_tokens >= 32
    assert any(s.prefilling for s in many.steps), "a prompt was split in chunks"
    if config.sliding_window:
        assert config.sliding_window == 8
        assert many.engine.cache.num_window_freed == one.engine.cache.num_window_freed > 0


# --- the engine's features at world 2 --------------------------------------------------------------
SYSTEM = prompts([37], DEMO_VOCAB, seed=3)[0]  # two full blocks of 16 and a partial one


def test_prefix_cache_hits_at_world_2_are_one_ranks():
    """A shared 37-token prefix: 2 prompts first, then 3 more with it and the first prompt again,
    which find its full blocks cached. The other rank must read the K/V of its heads from the same
    cached blocks rank 0 reuses (its table follows rank 0's, with no K/V recomputed there): a rank
    that recomputed, or kept its own table, would answer otherwise."""
    first = [SYSTEM + [5, 6, 7], SYSTEM + [9]]
    later = [SYSTEM + p for p in prompts([1, 12, 20], DEMO_VOCAB, seed=4)] + [first[0]]
    many, one, _ = assert_same_as_one_rank(2, demo_opts(), greedy(first, 12, queued=later))
    hits = many.engine.scheduler.cached_prompt_tokens
    assert hits == one.engine.scheduler.cached_prompt_tokens
    assert hits >= 4 * 32, f"{hits} cached prompt tokens: the later prompts were meant to find the prefix"
    assert many.tokens[5] == many.tokens[0], "the same prompt again, from the cache: the same answer"


def test_chunked_prefill_at_world_2_is_one_ranks():
    """A 90-token prompt in chunks of at most 5 tokens a step beside two decoding sequences: each
    chunk's plan carries the positions it starts at, and a rank that wrote a chunk's K/V at the wrong
    positions, or attended to the wrong prefix of it, would answer otherwise."""
    prompt_list = prompts([4, 11], DEMO_VOCAB, seed=6) + prompts([90], DEMO_VOCAB, seed=7)
    many, _, _ = assert_same_as_one_rank(2, demo_opts(max_num_batched_tokens=5), greedy(prompt_list, 14))
    assert all(s.num_tokens <= 5 for s in many.steps)
    assert sum(1 for s in many.steps if s.prefilling) >= 90 // 5 - 2, "the long prompt went in many chunks"
    whole, _ = at_world(1, demo_opts(chunked_prefill=False), greedy(prompt_list, 14))
    assert many.tokens == whole.tokens, "chunked is unchunked"


def test_preemption_at_world_2_is_one_ranks():
    """A pool of 8 blocks a layer (128 tokens) for 4 sequences that need 237 in all, in chunks of 7:
    sequences are preempted (part-way prompts among them) and recomputed, their blocks handed to
    others; the other rank's table must let go and take up the same blocks as rank 0's."""
    prompt_list = prompts([20, 35, 12, 50], DEMO_VOCAB, seed=4)
    opts = demo_opts(num_blocks=5 * 8, max_num_batched_tokens=7)
    many, one, _ = assert_same_as_one_rank(2, opts, greedy(prompt_list, 30))
    assert many.engine.scheduler.num_preemptions == one.engine.scheduler.num_preemptions > 0
    roomy, _ = at_world(1, demo_opts(num_blocks=5 * 48), greedy(prompt_list, 30))
    assert many.tokens == roomy.tokens, "preempted and recomputed is what a roomy pool answers"


def test_decode_steps_queued_ahead_at_world_2_are_one_ranks():
    """The engine's overlap (on by default on GPUs; forced here on the CPU): a decode step queued
    before the last one's tokens reach the host feeds them from the device, and rank 0 broadcasts
    them to the other ranks (the plan says `fed`, not the tokens). A rank that fed its stand-in
    zeros instead would write other K/V and answer otherwise."""
    plain = greedy(prompts([3, 18, 9], DEMO_VOCAB, seed=8), 20)

    def queued_ahead(engine):
        engine.overlap = True
        return plain(engine)

    many, one, _ = assert_same_as_one_rank(2, demo_opts(), queued_ahead)
    assert many.engine.num_launched_ahead > 0 and one.engine.num_launched_ahead > 0, "no step was queued ahead"
    alone, _ = at_world(1, demo_opts(), plain)
    assert many.tokens == alone.tokens, "queued ahead is what step by step answers"


def test_parallel_samples_at_world_2_share_blocks_and_are_one_ranks():
    """--n 3 of a 37-token prompt (a partial last block, shared): each sample's first token makes
    rank 0 copy that block (copy-on-write) and the plan carries the copy; a rank that skipped it
    would write every sample's K/V into one block and give other logits. Seeded sampling at
    temperature 0.9 draws the same tokens (rank 0 samples from the gathered logits)."""
    def body(engine):
        logits = record_logits(engine)
        params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=12, ignore_eos=True, seed=100 + j)
                  for j in range(3)]
        seqs, outs = engine.add_parallel(SYSTEM, params), []
        while engine.has_unfinished:
            outs.append(engine.step())
            check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks, "a block leaked"
        return Run([s.output_token_ids for s in seqs], [logits[s.id] for s in seqs], outs, engine)

    many, one, _ = assert_same_as_one_rank(2, demo_opts(), body)
    assert many.engine.cache.num_copied_blocks == one.engine.cache.num_copied_blocks > 0
    assert len({tuple(t) for t in many.tokens}) > 1, "the samples differ from each other"


# --- sizes the ranks cannot take -------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 65])
def test_a_size_out_of_range_is_one_line(size):
    """0 ranks or more than 64: refused by the options (before any worker starts), one line naming
    the value and the range, in the library and through the command."""
    with pytest.raises(UsageError, match=f"`tensor_parallel_size` {size}: needs 1 to 64"):
        EngineOptions(model="demo", tensor_parallel_size=size)
    code, _, stderr = invoke("generate", "--model", "demo", "-tp", str(size), "ROMEO:")
    assert_one_line(code, stderr, 2, f"--tensor-parallel-size {size}: needs 1 to 64")


@pytest.mark.parametrize("flags", [["--quality"], ["--kernel"], ["--compare", "hf"]], ids=lambda f: f[-1])
def test_bench_modes_that_run_on_one_device_refuse_ranks(flags):
    """bench's --quality (a model loaded a variant), --kernel (our kernels on one rank's pool) and
    --compare hf (transformers built from our weights: a rank's share) cannot run over ranks: one
    line, exit 2, before any worker starts, not a hang or a wrong figure."""
    code, _, stderr = invoke("bench", "--model", "demo", "-tp", "2", *flags)
    assert_one_line(code, stderr, 2, f"{' '.join(flags)} runs on one device", "--tensor-parallel-size")


def test_a_size_that_does_not_divide_the_heads_is_one_line():
    """check_divides: a world that does not divide the query heads, the MLP's columns, or the KV heads
    (nor is a multiple of them, to replicate them) is one UsageError naming the value and what it
    fails to divide; a world that replicates KV heads, or divides all, passes."""
    demo = opts_config(EngineOptions(model="demo"))  # 4 query heads, 2 KV heads, 512 columns
    for world in (1, 2, 4):
        check_divides(demo, world)
    with pytest.raises(UsageError, match="`tensor_parallel_size` 3 does not divide the model's 4 query heads"):
        check_divides(demo, 3)
    with pytest.raises(UsageError, match="`tensor_parallel_size` 8 does not divide the model's 4 query heads"):
        check_divides(demo, 8)
    columns = replace(demo, intermediate_size=510)
    with pytest.raises(UsageError, match="does not divide the model's 510 intermediate_size"):
        check_divides(columns, 4)
    kv = replace(demo, num_heads=12, num_kv_heads=3, intermediate_size=512)
    with pytest.raises(UsageError, match="neither divides the model's 3 KV heads nor is a multiple"):
        check_divides(kv, 4)
    with pytest.raises(UsageError):
        check_divides(replace(demo, num_kv_heads=3), 2)


def test_a_size_that_does_not_divide_the_heads_through_the_command():
    """`pagedcli generate -tp 3` on the demo (4 query heads): exit code 2, one `error:` line naming 3
    and the heads, no traceback, nothing on stdout, and no worker it started left running (a real
    process: the workers are spawned, and rank 0's watch over them must not turn the refusal into a
    worker's death)."""
    import psutil

    proc = subprocess.Popen([*PAGEDCLI, "generate", "--model", "demo", "-tp", "3", "ROMEO:"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = []
    while proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children() or children
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=60)
    assert_one_line(proc.returncode, stderr, 2, "--tensor-parallel-size 3 does not divide the model's 4 query heads")
    assert stdout == ""
    assert not left_running(children, 5)


# --- the command, with worker processes ------------------------------------------------------------
def left_running(processes, within: float) -> list[int]:
    """The pids of `processes` (psutil.Process) still running after `within` seconds (zombies are done)."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_the_command_at_2_ranks_prints_what_one_rank_prints():
    """`pagedcli generate --temperature 0 --max-tokens 20 -tp 2 "ROMEO:"` as a user runs it (a
    spawned worker process): the same text as without -tp, exit code 0, no error."""
    args = ["generate", "--model", "demo", "--temperature", "0", "--max-tokens", "20"]
    code, one, err = invoke(*args, "ROMEO:")  # (one rank: in this process)
    two = subprocess.run([*PAGEDCLI, *args, "-tp", "2", "ROMEO:"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    assert code == 0, err
    assert two.returncode == 0, two.stderr
    assert two.stdout == one and len(one) > len("ROMEO:") + 20
    assert "error" not in two.stderr and "Traceback" not in two.stderr
    assert "20 tokens in" in two.stderr


def start_long_run():
    """`pagedcli generate -tp 2 --max-tokens 100000 --ignore-eos "ROMEO:"` (about 500 tokens, some
    seconds at 2 ranks on 2 cores), once it prints generated text: the process and its worker."""
    import psutil

    proc = subprocess.Popen([*PAGEDCLI, "generate", "--model", "demo", "-tp", "2", "--max-tokens", "100000",
                             "--ignore-eos", "ROMEO:"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while len(seen) < len("ROMEO:") + 10:  # the prompt, then generated text: steps run on both ranks
        chunk = os.read(proc.stdout.fileno(), 64)
        if not chunk:
            proc.kill()
            raise AssertionError(f"it ended before generating: {proc.communicate()[1].decode()}")
        seen += chunk
    workers = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 1, workers
    return proc, workers[0]


def signalled(proc, target, signum, within: float) -> str:
    """`signum` to `target` (the command or its worker), then the command's stderr once it ends,
    within `within` seconds (else the test fails; the command is killed whatever happens)."""
    target.send_signal(signum)
    try:
        return proc.communicate(timeout=within)[1].decode()
    finally:
        proc.kill()


def test_a_ctrl_c_during_a_step_waits_for_the_step_to_end_on_every_rank():
    """Rank 0 interrupted between two collectives would leave the other ranks in that step's next
    one, out of step for good (chat goes on after a Ctrl-C): `interrupts_held` holds the SIGINT until
    the step's end, then delivers it as it would have been."""
    from pagedcli.engine.ranks import interrupts_held

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached.append("the rest of the step")  # (an interrupt on arrival would skip this)
    assert reached == ["the rest of the step"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the handler before is back"


def test_ctrl_c_on_the_command_at_2_ranks_ends_it_as_at_one():
    """SIGINT to `generate -tp 2` mid-answer: exit code 130 as at one rank, within seconds, no
    traceback, and its worker gone with it."""
    proc, worker = start_long_run()
    stderr = signalled(proc, proc, signal.SIGINT, 15)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert not left_running([worker], 10), "the worker outlived rank 0"


def test_a_killed_worker_ends_the_run_with_one_line_and_exit_code_1():
    """SIGKILL to rank 1 mid-generation: rank 0 must not hang in its next collective nor print a
    traceback of the failed all-reduce; it says which rank stopped and how, in one last line, and
    exits with code 1 within seconds."""
    proc, worker = start_long_run()
    stderr = signalled(proc, worker, signal.SIGKILL, 10)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "tensor-parallel rank 1 stopped" in last and "signal 9" in last, stderr
    assert_one_line(proc.returncode, stderr, 1, "tensor-parallel rank 1 stopped")


def test_a_killed_rank_0_leaves_no_worker_running():
    """SIGKILL to the command (no atexit, no goodbye): its worker finds rank 0 gone at its next
    collective and exits, rather than holding the model's share of memory forever."""
    import psutil

    proc, worker = start_long_run()
    others = psutil.Process(proc.pid).children()  # the worker, and multiprocessing's resource tracker
    proc.kill()
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()
    assert worker in others
    left = left_running(others, 10)
    if left:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"{left} outlived rank 0 by 10 s"


def test_the_server_at_2_ranks_answers_as_one_rank():
    """`pagedcli serve -tp 2` (the engine process starts the worker): a greedy /v1/completions answer
    is the text one rank generates for the prompt; Ctrl-C stops it with exit code 0, and every
    process it started (the engine process, the worker) ends with it."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import psutil

    code, expected, _ = invoke("generate", "--model", "demo", "--temperature", "0", "--max-tokens", "20", "ROMEO:")
    assert code == 0
    proc, url = start_server("-tp", "2")
    try:
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(p.cmdline()) for p in processes)
        reply = httpx.post(f"{url}/completions", json={"model": "demo", "prompt": "ROMEO:", "max_tokens": 20,
                                                       "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert expected.rstrip("\n") == "ROMEO:" + choice["text"].rstrip("\n")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr and "error:" not in stderr, stderr
        assert not left_running(processes, 10), "a process of the server outlived it"
    finally:
        proc.kill()


def test_a_killed_server_at_2_ranks_leaves_no_process_running():
    """SIGKILL to `pagedcli serve -tp 2`: its engine process sees its pipe close and ends, and so
    must the worker it started (and multiprocessing's resource trackers), within seconds, as at
    one rank (test_serve_processes) - none may hold the model's memory on."""
    import psutil

    proc, _ = start_server("-tp", "2")
    processes = psutil.Process(proc.pid).children(recursive=True)
    try:
        assert any("spawn_main" in " ".join(p.cmdline()) and p.ppid() != proc.pid for p in processes), "no worker"
        proc.kill()
        proc.wait(10)
        left = left_running(processes, 5)
        assert not left, f"{left} outlived the server by 5 s"
    finally:
        proc.kill()
        for p in processes:  # (whatever the outcome: no process of this test's left behind)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
