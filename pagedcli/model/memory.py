"""Sizing the pool to a share of the GPU: `gpu_memory_utilization`, as vLLM means it.

The whole process may use that fraction of the GPU's total memory. What it holds besides the pool
is the weights and the activations of the largest step it will run, which a profiling forward pass
of that step measures (torch's peak allocation, as vLLM profiles); the pool gets the rest. The
arithmetic is `pool_bytes_for`, a pure function; the loader's profiling pass and `device_memory`
are the only calls into torch.cuda.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from pagedcli.errors import RunError, UsageError

GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory
    free: int  # free on the device now, with the weights loaded (other processes hold the rest)
    weights: int  # the weights' bytes, on the device
    activations: int  # peak bytes the largest step allocates beyond the weights and the pool


def check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:  # (NaN fails it too)
        raise UsageError(f"`gpu_memory_utilization` {fraction}: must be above 0 and at most 1",
                         "e.g. 0.9: the share of the GPU's memory the process may use")


def pool_bytes_for(fraction: float, m: MemoryProfile) -> int:
    """The pool's bytes: fraction x total, less the weights and the peak activations. Refused when
    other processes hold more than the fraction leaves this one (vLLM refuses it too), or when the
    weights and activations take it all."""
    check_fraction(fraction)
    allowed = int(fraction * m.total)
    ours = m.free + m.weights  # what this process can have at most
    if allowed > ours:
        raise UsageError(f"`gpu_memory_utilization` {fraction} allows {allowed / GIB:.1f} GiB of the GPU's "
                         f"{m.total / GIB:.1f} GiB, but other processes hold all but {ours / GIB:.1f} GiB",
                         f"use `gpu_memory_utilization` {int(100 * ours / m.total) / 100} or less")
    pool = allowed - m.weights - m.activations
    if pool <= 0:
        raise UsageError(f"`gpu_memory_utilization` {fraction} allows {allowed / GIB:.1f} GiB, which the weights "
                         f"({m.weights / GIB:.1f} GiB) and the largest step's activations "
                         f"({m.activations / GIB:.1f} GiB) already take",
                         "raise `gpu_memory_utilization`, or lower `max_num_batched_tokens`")
    return pool


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the GPU now, after torch hands back what it caches unused (the
    profiling engine's pool among it)."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return free, total


# --- the weights in the host's memory -----------------------------------------------------------
def weight_bytes(config, dtype: torch.dtype, fp8: bool) -> int:
    """The weights' bytes once loaded: every parameter in `dtype`, or with fp8 weights (model/fp8.py)
    the linear layers and the LM head a byte each, the embeddings in `dtype`, and a tied LM head an
    fp8 copy of them (per-row scales left out: a few KB)."""
    embed = config.vocab_size * config.hidden_size
    if not fp8:
        return config.num_parameters * dtype.itemsize
    return config.num_parameters - embed + embed * dtype.itemsize + (embed if config.tie_word_embeddings else 0)


def available_host_memory() -> int | None:
    """The bytes Linux says a new allocation can have without swapping (MemAvailable), or None
    where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_weights_fit(config, dtype: torch.dtype, device: torch.device | str, fp8: bool) -> None:
    """Refuse, in one line, weights that the host's free memory cannot hold, before they are read:
    past it Linux's out-of-memory killer ends the process without a word, where a GPU's allocator
    fails with an error (errors.allocation_failure says that one)."""
    if torch.device(device).type != "cpu" or (available := available_host_memory()) is None:
        return
    need = weight_bytes(config, dtype, fp8)
    if need <= available:
        return
    name = str(dtype).removeprefix("torch.") + (" with fp8 weights" if fp8 else "")
    if dtype == torch.float32:
        hint = "use `dtype` bfloat16 (half the bytes), or a smaller model"
    elif not fp8:
        hint = "use `quantization` fp8 (about half the bytes), or a smaller model"
    else:
        hint = "use a smaller model, or free memory"
    raise RunError(f"the weights ({need / GIB:,.1f} GiB in {name}) do not fit in the {available / GIB:,.1f} GiB "
                   "of memory this machine has free", hint)
