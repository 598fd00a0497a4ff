"""--gpu-memory-utilization: the pool's arithmetic (pure, fake numbers), the largest step the
profiling pass runs, and the option's errors. The profiling pass itself needs a GPU."""

from __future__ import annotations

import pytest

from helpers import fake_gpu, invoke
from pagedcli.core.errors import UsageError
from pagedcli.engine.build import largest_step
from pagedcli.core.options import EngineOptions
from pagedcli.engine.memory import GIB, MemoryProfile, pool_bytes_for

import torch


def test_the_pool_gets_the_share_less_weights_and_activations():
    m = MemoryProfile(total=80 * GIB, free=70 * GIB, weights=5 * GIB, activations=3 * GIB)
    assert pool_bytes_for(0.9, m) == int(0.9 * 80 * GIB) - 8 * GIB
    assert pool_bytes_for(0.5, m) == 32 * GIB


def test_memory_other_processes_hold_is_not_ours():
    m = MemoryProfile(total=80 * GIB, free=30 * GIB, weights=5 * GIB, activations=1 * GIB)  # 45 GiB elsewhere
    assert pool_bytes_for(0.4, m) == 32 * GIB - 6 * GIB
    with pytest.raises(UsageError, match=r"other processes hold all but 35.0 GiB.*0.43 or less"):
        pool_bytes_for(0.9, m)


def test_no_room_left_for_a_pool():
    m = MemoryProfile(total=16 * GIB, free=14 * GIB, weights=2 * GIB, activations=3 * GIB)
    with pytest.raises(UsageError, match="already take"):
        pool_bytes_for(0.3, m)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(UsageError, match="must be above 0 and at most 1"):
            pool_bytes_for(bad, m)


def test_the_profiled_step_is_the_largest_the_engine_runs(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200", 141 * GIB)
    cuda = torch.device("cuda")
    assert largest_step(EngineOptions(batch=4), cuda, 131072) == [1, 1, 1, 16381]  # an H200's 16384-token budget
    assert largest_step(EngineOptions(batch=4, serving=True), cuda, 131072) == [1, 1, 1, 8189]  # serve's 8192
    assert largest_step(EngineOptions(batch=4, max_num_batched_tokens=100), cuda, 131072) == [1, 1, 1, 97]
    # unchunked, one whole prompt may be as long as the model allows
    assert largest_step(EngineOptions(batch=2, chunked_prefill=False, max_model_len=20000), cuda, 131072) == [1, 19999]
    assert largest_step(EngineOptions(batch=1), cuda, 2048) == [2047]  # no longer than the model's context


@pytest.mark.parametrize("other", [["--cache-size", "1GiB"], ["--num-blocks", "64"]])
def test_one_way_to_size_the_pool(stories, other):
    code, _, err = invoke("generate", "--model", str(stories), "--gpu-memory-utilization", "0.9", *other, "hi")
    assert code == 2 and "--gpu-memory-utilization and " + other[0] + " both size the pool" in err
    assert len(err.strip().splitlines()) == 1


def test_refused_on_the_cpu(stories):
    code, _, err = invoke("generate", "--model", str(stories), "--device", "cpu", "--gpu-memory-utilization", "0.5",
                          "hi")
    assert code == 2 and "this run is on the CPU" in err and "--cache-size" in err
