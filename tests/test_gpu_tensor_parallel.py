"""Tensor parallelism on GPUs (NCCL, one rank a GPU): `-tp 2` must print what `-tp 1` prints, greedy,
through the command line's own worker processes, with and without CUDA graphs (the all-reduce inside
them). Skipped without two GPUs, CUDA and CuPy: the CPU side (gloo) is tests/test_tensor_parallel.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _two_gpus() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0] and torch.cuda.device_count() >= 2


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs, CUDA and CuPy")]


def generate(*args: str) -> str:
    command = [sys.executable, "-m", "pagedcli", "generate", "--device", "cuda", "--temperature", "0", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("model", ["demo", "random:llama-3.2-1b"])
def test_tp2_on_nccl_prints_what_tp1_prints(model, eager):
    """The shares' partial products summed by NCCL give tp 1's greedy tokens (float32, where a
    different order of the sum cannot tip an argmax the demo's margins decide)."""
    args = ["--model", model, "--dtype", "float32", "--max-tokens", "48", "--ignore-eos", "--batch", "3",
            "ROMEO:", "JULIET: O", "First Citizen:"]
    args += ["--eager"] if eager else []
    assert generate(*args, "-tp", "2") == generate(*args)
