"""How the CUDA backend launches its kernels: split-KV splits and thread-block clusters of the
decode attention, warps per row of gemv.cu, and the scratch buffers they need; the prefill
kernel's tiles (their keys split where they are too few to fill the GPU); and the launch itself,
on torch's current stream.

Every decode choice depends on the batch size and the model (never on the contexts), so one CUDA
graph per batch size serves every context length; the scratch is allocated once per batch size and
reused by every layer and step. A prefill step's tiles follow its prompts: the host lists them each
step (a prefill graph stages them as its inputs, cuda_prefill_graphs.py).
"""

from __future__ import annotations

import ctypes
import heapq
import math
import struct
import sys
import threading
import warnings
from collections.abc import Collection
from typing import NamedTuple

import numpy as np
import torch

from pagedcli.backends.cuda_build import (
    GEMV_CTAS_PER_SM,
    GEMV_SPLITS,
    GEMV_THREADS,
    GEMV_UNROLL,
    PARTITION_SIZE,
    PREFILL_BLOCK_N,
    PREFILL_MAX_PARTS,
    PREFILL_SPLIT_MIN_TILES,
    SPLIT_CTAS_PER_SM,
    VEC_BYTES,
)
from pagedcli.core.batch import to_device
from pagedcli.core.kv_store import KVStore


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def row_threads(n: int, vec: int) -> int:
    """Threads of a CTA that takes one row of n elements, vec at a time (elementwise.cu's rms_norm,
    fp8_quant.cu): whole warps, at most 1024. The same count gives the same order of a row's sums."""
    return min(1024, max(32, -(-n // vec // 32) * 32))


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (the kernels' vector loads)."""
    return all(t.data_ptr() % VEC_BYTES == 0 for t in tensors)


class _LaunchAttribute(ctypes.Structure):  # cuda.h's CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # cuda.h's CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h's CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


PROGRAMMATIC_MIN_DRIVER = 12030  # CUDA 12.3: CUDA graphs capture programmatic launches from 12.3 on


def _driver_launch_ex():
    """The CUDA driver's cuLaunchKernelEx, or None where the driver is older than
    PROGRAMMATIC_MIN_DRIVER (or lacks it)."""
    try:
        driver = ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if driver.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < PROGRAMMATIC_MIN_DRIVER:
            return None
        launch = driver.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return launch


# struct formats of a kernel argument, each value in an 8-byte slot of its own (cuLaunchKernelEx
# reads each through its own pointer, as many bytes as its parameter's type)
_SLOT_FORMATS = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.uint32): "I4x",
                 np.dtype(np.int32): "i4x", np.dtype(np.float32): "f4x"}
MAX_KERNEL_ARGS = 32


class KernelArguments:
    """The buffer a launch's arguments are packed into for cuLaunchKernelEx, and the array of
    pointers to its slots that the call takes; reused by every launch (the driver has read the values
    when the call returns), under a lock in case two threads launch at once."""

    def __init__(self):
        self.values = ctypes.create_string_buffer(8 * MAX_KERNEL_ARGS)
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * MAX_KERNEL_ARGS)(*range(base, base + 8 * MAX_KERNEL_ARGS, 8))
        self.lock = threading.Lock()

    def pack(self, args: tuple) -> None:
        """Each argument (a numpy scalar of its parameter's type: ptr() for pointers) into its slot."""
        try:
            fmt = "<" + "".join(_SLOT_FORMATS[a.dtype] for a in args)
        except (AttributeError, KeyError):
            raise TypeError(f"kernel arguments must be numpy scalars of the parameters' types, not {args}") from None
        if len(args) > MAX_KERNEL_ARGS:
            raise ValueError(f"{len(args)} kernel arguments: at most {MAX_KERNEL_ARGS}")
        struct.pack_into(fmt, self.values, 0, *args)


class Launcher:
    """Launches compiled kernels (cupy.RawKernel) on torch's current stream: the capture stream
    while a CUDA graph is captured, so our kernels land in the graph beside torch's.

    With `programmatic` (sm_90+, cuda_build.PROGRAMMATIC_LAUNCH) and a driver of CUDA 12.3 or newer
    (`self.programmatic` says whether) each launch goes through the driver's cuLaunchKernelEx
    with programmatic stream serialization: the kernel may start before
    the previous kernel in the stream has finished, and waits for it where common.cuh says
    (`wait_for_previous_kernels`, which every kernel of ours calls). CUDA graphs keep the edge."""

    def __init__(self, kernels: dict, device_index: int, programmatic: bool = False):
        import cupy

        self.kernels, self.device_index = kernels, device_index
        self._device = cupy.cuda.Device(device_index)
        self._streams: dict[int, object] = {}  # torch stream handle -> cupy.cuda.ExternalStream
        self._launch_ex = _driver_launch_ex() if programmatic else None
        self.programmatic = self._launch_ex is not None
        self._functions: dict[str, int] = {}  # kernel name -> its CUfunction on this device
        self._arguments = KernelArguments()
        self._attribute = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION, b"", (1).to_bytes(4, "little"))
        self._config = _LaunchConfig(attrs=ctypes.pointer(self._attribute), num_attrs=1)

    def __call__(self, kernel: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        import cupy

        # the raw handle: torch.cuda.current_stream() builds a Stream object at every call, a cost
        # each launch of an eager prefill step paid (docs/performance-log.md, "Under arrivals")
        handle = torch._C._cuda_getCurrentRawStream(self.device_index)
        if self.programmatic:
            self._launch_programmatic(kernel, grid, block, args, shared_mem, handle)
            return
        stream = self._streams.get(handle)
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older ones lack the successor
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device_index)
        with self._device, stream:
            self.kernels[kernel](grid, block, args, shared_mem=shared_mem)

    def _launch_programmatic(self, kernel: str, grid: tuple, block: tuple, args: tuple, shared_mem: int,
                             stream: int) -> None:
        with self._device, self._arguments.lock:
            function = self._functions.get(kernel)
            if function is None:
                function = self._functions[kernel] = self.kernels[kernel].kernel.ptr
            self._arguments.pack(args)
            config = self._config
            config.grid[:] = (*grid, *(1,) * (3 - len(grid)))
            config.block[:] = (*block, *(1,) * (3 - len(block)))
            config.shared_mem, config.stream = shared_mem, stream
            status = self._launch_ex(ctypes.byref(config), function, self._arguments.pointers, None)
        if status != 0:  # a CUresult: what cupy's launch would have raised, with the kernel's name
            raise RuntimeError(f"cuLaunchKernelEx of {kernel} (grid {grid}, block {block}) failed: CUresult {status}")


def leading_single_rows(num_new: list[int]) -> int:
    """How many of a prefill-kind step's sequences, from the first, feed one token each: the
    decoding ones, which the scheduler puts first. paged_attention.cu serves them (their rows are
    the step's first tokens, so q and the output need no gather), reading a sequence's keys once for
    all the query heads of a KV group; a prefill tile would read them once per query head and
    multiply 16 rows or more for its one."""
    n = 0
    while n < len(num_new) and num_new[n] == 1:
        n += 1
    return n


class TileLists(NamedTuple):
    """paged_prefill.cu's work list for a step, a tile per entry (see prefill_tile_lists), and each
    sequence's first token in the step."""
    seq: list[int]  # the tile's sequence
    row: list[int]  # its first new row in that sequence
    part: list[int]  # which of its keys' ranges it covers
    parts: list[int]  # into how many ranges its keys are cut (1: all of them)
    starts: list[int]


class PrefillWork(NamedTuple):
    """A prefill step's attention work on the device: the prefill kernel's tiles (TileLists as int32
    tensors, `starts` as seq_start, and every sequence's new tokens), and the leading one-token
    sequences' slots and contexts, which the decode kernel serves."""
    tile_seq: torch.Tensor
    tile_row: torch.Tensor
    tile_part: torch.Tensor
    tile_parts: torch.Tensor
    seq_start: torch.Tensor
    num_new: torch.Tensor
    decode_slots: torch.Tensor
    decode_context: torch.Tensor


def window_first(pos: int, window: int | None) -> int:
    """The first key a query at `pos` sees under a sliding window (0 without one): kernels/geometry.cuh's."""
    return max(pos - window + 1, 0) if window else 0


def prefill_tile_lists(num_new: list[int], context_lens: list[int], rows: int, skip: int = 0,
                       elsewhere: Collection[int] = (), split_tiles: int = 0, window: int | None = None) -> TileLists:
    """paged_prefill.cu's work list for a step: a tile per `rows` new tokens of each sequence past
    the first `skip` (those the decode kernel serves) and not in `elsewhere` (those cudnn_prefill.py
    serves), the tiles that read the most keys first (a causal tile's keys end at its last row, and
    with a sliding `window` start at its first row's window: launched early, the long ones do not
    trail the rest). Where they are fewer than `split_tiles` (what fills the GPU,
    CudaBackend.prefill_split_tiles; 0: never split), the longest ones' keys are cut into parts
    (key_parts), each an entry of its own: those come first, a tile's parts in a row."""
    elsewhere = set(elsewhere)
    tiles = [(ctx - n + r + min(rows, n - r) - window_first(ctx - n + r, window), ctx - n + r, b, r)
             for b, (n, ctx) in enumerate(zip(num_new, context_lens)) if b >= skip and b not in elsewhere
             for r in range(0, n, rows)]  # (keys read, first row's position, sequence, row)
    parts = key_parts([t[0] for t in tiles], [t[1] for t in tiles], split_tiles, window)
    order = sorted(range(len(tiles)), key=lambda i: (parts[i] == 1, -tiles[i][0]))
    lists = TileLists([], [], [], [], [0])
    for i in order:
        _, _, seq, row = tiles[i]
        for p in range(parts[i]):
            lists.seq.append(seq)
            lists.row.append(row)
            lists.part.append(p)
            lists.parts.append(parts[i])
    for n in num_new[:-1]:
        lists.starts.append(lists.starts[-1] + n)
    return lists


def key_parts(keys: list[int], first_pos: list[int], split_tiles: int, window: int | None = None) -> list[int]:
    """Into how many parts each tile's keys are cut so that the list holds up to `split_tiles`
    entries: one more part at a time to the tile whose parts are longest. A part takes at least
    PREFILL_SPLIT_MIN_TILES of the key tiles that start at or before the tile's first row (from the
    one holding its first row's window's first key, with a sliding `window`), which
    paged_prefill.cu cuts evenly, the diagonal's going to the last part; a tile at most
    PREFILL_MAX_PARTS parts."""
    parts = [1] * len(keys)
    spare = split_tiles - len(keys)
    if spare <= 0:
        return parts
    lead = [f // PREFILL_BLOCK_N + 1 - window_first(f, window) // PREFILL_BLOCK_N for f in first_pos]
    most = [min(PREFILL_MAX_PARTS, n // PREFILL_SPLIT_MIN_TILES) for n in lead]
    longest = [(-k, i) for i, k in enumerate(keys) if most[i] > 1]  # (-keys a part, tile)
    heapq.heapify(longest)
    while spare and longest:
        _, i = heapq.heappop(longest)
        parts[i] += 1
        spare -= 1
        if parts[i] < most[i]:
            heapq.heappush(longest, (-keys[i] / parts[i], i))
    return parts


def max_prefill_tiles(num_tokens: int, num_seqs: int, rows: int, split_tiles: int = 0) -> int:
    """The most entries the work list of `num_tokens` new tokens of `num_seqs` sequences has: each
    sequence's last tile may be partial, and splits fill the list up to `split_tiles`."""
    return max(-(-num_tokens // rows) + min(num_seqs, num_tokens), split_tiles)


def prefill_work(num_new: list[int], context_lens: list[int], rows: int, device: torch.device,
                 decode_slots: torch.Tensor, decode_context: torch.Tensor, skip: int = 0,
                 elsewhere: Collection[int] = (), split_tiles: int = 0, window: int | None = None) -> PrefillWork:
    """prefill_tile_lists on `device` in one host-to-device copy (batch.to_device), with the decode
    kernel's rows."""
    lists = prefill_tile_lists(num_new, context_lens, rows, skip, elsewhere, split_tiles, window)
    int32 = torch.int32
    t = to_device({"seq": (lists.seq, int32), "row": (lists.row, int32), "part": (lists.part, int32),
                   "parts": (lists.parts, int32), "start": (lists.starts, int32),
                   "num_new": (list(num_new), int32)}, device)
    return PrefillWork(t["seq"], t["row"], t["part"], t["parts"], t["start"], t["num_new"], decode_slots,
                       decode_context)


def resident_ctas(kernel, threads: int, device_index: int, fallback: int, dynamic_shared: int = 0) -> int:
    """CTAs of a compiled kernel (a cupy.RawKernel) one SM holds at once (registers, shared memory,
    static and the launch's `dynamic_shared` bytes, threads); `fallback` (what the launch bounds
    promise) where this CuPy lacks the attributes."""
    import cupy

    try:
        props = cupy.cuda.runtime.getDeviceProperties(device_index)
        regs_per_warp = -(-kernel.num_regs * 32 // 256) * 256  # allocated per warp, 256 at a time
        by_regs = props["regsPerMultiprocessor"] // (regs_per_warp * (threads // 32))
        shared = kernel.shared_size_bytes + dynamic_shared + 1024  # 1 KiB reserved a CTA
        by_smem = props["sharedMemPerMultiprocessor"] // shared
        by_threads = props["maxThreadsPerMultiProcessor"] // threads
        return max(1, min(by_regs, by_smem, by_threads))
    except Exception:  # attributes missing in this CuPy: what the launch bounds promise
        return fallback


class LaunchShapes:
    def __init__(self, store: KVStore, num_heads: int, heads_per_cta: int, vec: int, num_sms: int, cluster: int,
                 window: int | None = None):
        self.store = store
        self.window = window  # a sliding window's length (the model's), or None
        self.num_heads, self.heads_per_cta = num_heads, heads_per_cta
        self.head_dim = store.geometry.head_dim
        self.vec = vec  # elements in a 16-byte vector
        self.num_sms = num_sms
        self.cluster = cluster  # CTAs a decode cluster has (1: no clusters, before sm_90)
        self.split_scratch: dict[int, tuple] = {}  # batch size -> (splits, partial out/max/sum, merge counters)
        self.argmax_scratch: dict[int, tuple] = {}  # batch size -> (keys, counters), zero between launches

    def num_splits(self, batch_size: int) -> int:
        """Splits of the decode kernel for a batch size: enough CTAs to fill the GPU at small batches
        (at most SPLIT_CTAS_PER_SM per SM), no more than the longest context has chunks; with
        clusters, a multiple of the cluster size. Depends on nothing else (not the contexts), so one
        CUDA graph per batch size serves every context length: the kernel cuts each actual context
        into this many spans. With a sliding window a context's keys are at most the window and the
        rest of its first block (paged_attention.cu): no more splits than those have chunks."""
        keys = self.store.max_model_len
        if self.window:
            keys = min(keys, self.window + self.store.geometry.block_size - 1)
        chunks = math.ceil(keys / PARTITION_SIZE)
        splits = max(1, min(chunks, self._split_budget(batch_size)))
        if self.uses_clusters(batch_size):
            splits = self.cluster * max(1, splits // self.cluster)
        return splits

    def uses_clusters(self, batch_size: int) -> bool:
        """Whether decode attention runs in clusters at this batch size: when a whole cluster for
        every (sequence, head group) fits in the CTAs the splits may use (batch 1 to 8 at
        Llama-3.2-1B on an H200); larger batches fill the GPU without splitting short contexts."""
        return self.cluster > 1 and self._split_budget(batch_size) >= self.cluster

    def _split_budget(self, batch_size: int) -> int:
        """The most splits SPLIT_CTAS_PER_SM CTAs an SM allow, one CTA per (sequence, head group) a split."""
        return SPLIT_CTAS_PER_SM * self.num_sms // (batch_size * (self.num_heads // self.heads_per_cta))

    def scratch_for(self, batch_size: int) -> tuple:
        """Split-KV scratch for a batch size, allocated once and reused by every layer and step: the
        splits' partial outputs, maxima and sums, and one merge counter per (sequence, head group),
        zero between launches (the kernel resets what it counts)."""
        s = self.split_scratch.get(batch_size)
        if s is None:
            splits = self.num_splits(batch_size)
            f32 = dict(dtype=torch.float32, device=self.store.device)
            s = self.split_scratch[batch_size] = (
                splits,
                torch.empty((batch_size, self.num_heads, splits, self.head_dim), **f32),
                torch.empty((batch_size, self.num_heads, splits), **f32),
                torch.empty((batch_size, self.num_heads, splits), **f32),
                torch.zeros((batch_size, self.num_heads // self.heads_per_cta), dtype=torch.int32,
                            device=self.store.device),
            )
        return s

    def argmax_scratch_for(self, batch_size: int, device: torch.device) -> tuple:
        """argmax.cu's keys and counters for a batch size, allocated once (zero between launches)."""
        if batch_size not in self.argmax_scratch:
            z = {"device": device}
            self.argmax_scratch[batch_size] = (torch.zeros(batch_size, dtype=torch.int64, **z),
                                               torch.zeros(batch_size, dtype=torch.int32, **z))
        return self.argmax_scratch[batch_size]

    def gemv_split(self, units: int, K: int, weight_itemsize: float | None = None,
                   ctas_per_sm: int = GEMV_CTAS_PER_SM) -> int:
        """Warps per unit of gemv.cu: the most of GEMV_SPLITS whose warps still fit in one wave of
        `ctas_per_sm` CTAs an SM (GEMV_CTAS_PER_SM; compressed weights' kernels hold fewer), each
        warp with at least one tile of K (Llama-3.2-1B at batch 1: 2 for o, down and qkv, 1 for
        gate/up and the LM head). weight_itemsize: 1 for fp8 weights (16 to a load), 0.5 for 4-bit
        ones (32), else the model dtype's."""
        warp_slots = ctas_per_sm * self.num_sms * (GEMV_THREADS // 32)
        vec = self.vec if weight_itemsize is None else round(VEC_BYTES / weight_itemsize)
        tiles = -(-K // (32 * vec * GEMV_UNROLL))  # gemv.cu's tile_elems: a warp's 16-byte loads of one step
        return max(s for s in GEMV_SPLITS if s == 1 or (units * s <= warp_slots and s <= tiles))

    def gemv_ctas(self, units: int, split: int, ctas_per_sm: int = GEMV_CTAS_PER_SM) -> int:
        """gemv.cu's grid: a warp per (unit, split), in at most one wave of `ctas_per_sm` CTAs an SM."""
        return min(-(-units * split // (GEMV_THREADS // 32)), ctas_per_sm * self.num_sms)
