"""Sizing the pool to a share of the GPU: `gpu_memory_utilization`, as vLLM means it.

The whole process may use that fraction of the GPU's total memory. What it holds besides the pool
is the weights and the activations of the largest step it will run, which a profiling forward pass
of that step measures (torch's peak allocation, as vLLM profiles); the pool gets the rest. The
arithmetic is `pool_bytes_for`, a pure function; engine/build.py's profiling pass and `device_memory`
are the only calls into torch.cuda.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from pagedcli.core.errors import UsageError
from pagedcli.core.options import check_fraction

GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory
    free: int  # free on the device now, with the weights loaded (other processes hold the rest)
    weights: int  # the weights' bytes, on the device
    activations: int  # peak bytes the largest step allocates beyond the weights and the pool


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
