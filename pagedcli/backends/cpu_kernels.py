"""Our CPU kernels (kernels/cpu_gemv.c): the products of a decode step's few rows by a float32 weight
(1 to MAX_ROWS rows), or of one row by a grouped 8-bit or 4-bit QuantWeight, read at the memory's
speed. oneDNN's one-row product reads float32 weights at about two thirds of it on this project's
CPU, and grouped 8-bit weights have no torch CPU kernel at all (docs/performance.md, "CPU decode").

The source is built once per machine with its C compiler (`CC`, else `cc`), for its own vector
width (-march=native), into ~/.cache/pagedcli/cpu-kernels/ under a name that hashes the source, the
flags, the compiler and the CPU's flags; then loaded through ctypes. Without a compiler, or where
the build fails, `library()` is None and the backend keeps oneDNN and torch's kernels (with the
reason, `unavailable()`). `PAGEDCLI_CPU_KERNELS=0` turns them off (A/B runs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedcli.backends.cuda_compile import kernel_folder
from pagedcli.model.quant import QuantWeight

MAX_ROWS = 8  # the most rows a call takes (cpu_gemv.c's MAX_ROWS): decode batches; more go to oneDNN
SWITCH_VAR = "PAGEDCLI_CPU_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_TIMEOUT_S = 120


def cache_folder() -> Path:
    """~/.cache/pagedcli/cpu-kernels ($XDG_CACHE_HOME where it is an absolute path, as the XDG spec
    says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "pagedcli" / "cpu-kernels"


def cpu_flags() -> str:
    """The CPU's feature flags (a home folder shared by machines must not hand one's build to another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def private(folder: Path) -> bool:
    """Whether only this user can write into `folder`: a library loaded from it runs as this process,
    so one that another user could have put there is not loaded."""
    info = folder.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    if os.environ.get(SWITCH_VAR) == "0":
        return None, f"{SWITCH_VAR}=0"
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return None, "no C compiler (cc) to build kernels/cpu_gemv.c"
    source = kernel_folder() / "cpu_gemv.c"
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\n".join([source.read_text(), " ".join(FLAGS), version, cpu_flags()]).encode()).hexdigest()
        folder = cache_folder()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not private(folder):
            return None, f"{folder} may be written by other users: kernels are not loaded from it"
        target = folder / f"cpu_gemv-{key[:16]}.so"
        for attempt in (1, 2):  # a cached library that does not load (cut short, say) is built again, once
            if not target.exists():
                with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved in whole
                    built = Path(tmp) / target.name
                    done = subprocess.run([*compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True,
                                          text=True, timeout=BUILD_TIMEOUT_S)
                    if done.returncode != 0:
                        first = (done.stderr.strip().splitlines() or ["no message"])[0]
                        return None, f"{Path(compiler[0]).name} could not build kernels/cpu_gemv.c ({first[:160]})"
                    os.replace(built, target)
            try:
                lib = ctypes.CDLL(str(target))
                break
            except OSError:
                if attempt == 2:
                    raise
                target.unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"kernels/cpu_gemv.c could not be built or loaded ({str(e)[:160]})"
    for name in ("pagedcli_gemv_f32", "pagedcli_gemv_q8", "pagedcli_gemv_q4", "pagedcli_grouped_kernels"):
        getattr(lib, name).restype = ctypes.c_int
    return lib, ""


@functools.cache
def grouped() -> bool:
    """Whether the grouped 8-bit and 4-bit kernels were built (AVX-512; cpu_gemv.c says why)."""
    lib = library()
    return lib is not None and bool(lib.pagedcli_grouped_kernels())


def library() -> ctypes.CDLL | None:
    return _built()[0]


def unavailable() -> str:
    """Why the kernels are not used ("" when they are)."""
    return _built()[1]


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def gemv(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) for float32 activations: at most MAX_ROWS rows by a float32 weight, or one
    row by a QuantWeight; None where the kernels do not serve (the caller's path then, which also
    says what is wrong with shapes that do not fit)."""
    lib = library()
    rows = x.shape[0] if x.dim() == 2 else 0
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or not 1 <= rows <= MAX_ROWS
            or x.shape[1] != weight.shape[1]):
        return None
    x = x.contiguous()
    if isinstance(weight, QuantWeight):
        out = _grouped(lib, x, weight) if rows == 1 and grouped() else None
    elif (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
          and weight.dim() == 2 and weight.is_contiguous()):
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        if lib.pagedcli_gemv_f32(_ptr(x), _ptr(weight), _ptr(out), rows, weight.shape[0], weight.shape[1],
                                 torch.get_num_threads()):
            return None
    else:
        return None
    if out is not None and bias is not None:
        out += bias
    return out


def _grouped(lib, x: torch.Tensor, w: QuantWeight) -> torch.Tensor | None:
    n, k = w.shape
    if w.group % (32 if w.bits == 4 else 16) or k % w.group:
        return None
    parts = (w.q, w.scale) + ((w.offset,) if w.offset is not None else ())
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in parts):
        return None
    if w.scale.dtype != torch.float32 or (w.offset is not None and w.offset.dtype != torch.float32):
        return None
    out = torch.empty(1, n, dtype=torch.float32)
    kernel = lib.pagedcli_gemv_q8 if w.bits == 8 else lib.pagedcli_gemv_q4
    failed = kernel(_ptr(x), _ptr(w.q), _ptr(w.scale), _ptr(w.offset), _ptr(out), n, k, w.group,
                    torch.get_num_threads())
    return None if failed else out
