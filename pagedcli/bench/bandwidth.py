"""The device's memory bandwidth, the roofline's denominator: measured once per device with a
large copy, and kept in ~/.cache/pagedcli."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

BANDWIDTH_CACHE = Path.home() / ".cache" / "pagedcli" / "bandwidth.json"
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}  # the copy measured: far past every cache


def measure_bandwidth(device: torch.device) -> float:
    """Device memory bandwidth in GB/s from a large copy (bytes read + bytes written), measured
    once per device and kept in ~/.cache/pagedcli."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu:{torch.get_num_threads()}t"
    cached = _read_bandwidth_cache()
    if name in cached:
        return cached[name]
    nbytes = COPY_BYTES["cuda" if device.type == "cuda" else "cpu"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t)
    gbps = 2 * nbytes / statistics.median(times) / 1e9
    cached[name] = gbps
    try:
        BANDWIDTH_CACHE.parent.mkdir(parents=True, exist_ok=True)
        BANDWIDTH_CACHE.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass
    return gbps


def _read_bandwidth_cache() -> dict[str, float]:
    """The measured bandwidths, by device; a cache file that is missing, unreadable or not what this
    writes counts as empty (it is measured again and rewritten), and so does any entry that is not
    a positive number."""
    try:
        cached = json.loads(BANDWIDTH_CACHE.read_bytes().decode("utf-8"))
    except (OSError, ValueError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return {}
    if not isinstance(cached, dict):
        return {}
    return {k: float(v) for k, v in cached.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
