"""Compiling our kernels: the .cu sources with their headers pasted in, built by NVRTC through
CuPy with a plan's -D defines (cuda_build.plan_kernels), once per file, geometry and device; and
whether this machine can run them at all."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from pagedcli.core.errors import RunError

COMPILE_OPTIONS = ("-std=c++17",)  # no fast math: expf/rsqrtf/division keep their accuracy
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)
Defines = tuple[tuple[str, object], ...]


def kernel_folder() -> Path:
    """The .cu/.cuh files: the top-level kernels/ folder beside pagedcli/ in a checkout (an editable
    install runs from it too), or pagedcli/kernels/ where a wheel installed them (pyproject's
    package-dir maps the one to the other). Looked up by path, not imported: kernels/ has no
    __init__.py, so that it never shadows an installed package named `kernels`."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package.parent / "kernels", package / "kernels"):
        if (folder / "geometry.cuh").is_file():
            return folder
    raise RunError(f"the CUDA sources are missing (looked in {package.parent / 'kernels'} and {package / 'kernels'})",
                   "reinstall pagedcli")


def kernel_source(name: str) -> str:
    """The text of kernels/<name>, with each `#include "x.cuh"` replaced by that file: NVRTC then
    needs no include path, and CuPy's disk cache (keyed by the source text) sees header edits."""
    folder = kernel_folder()
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:  # every header has #pragma once; pasting it once is enough
            return ""
        seen.add(file)
        text = (folder / file).read_text(encoding="utf-8")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def define_flags(defines: Defines) -> list[str]:
    return [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines]


def cuda_available() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU and CuPy can use it; the string says why not, in one line."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return False, f"this torch ({torch.__version__}) is a CPU-only build"
        return False, "torch sees no CUDA GPU"
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); install cupy-cuda13x or cupy-cuda12x to match your CUDA"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "CuPy sees no CUDA GPU"
    except Exception as e:  # CuPy raises its own CUDA errors (driver too old, no device...)
        return False, f"CuPy cannot use the GPU ({type(e).__name__}: {e})"
    return True, ""


@functools.lru_cache(maxsize=None)
def compile_kernels(name: str, defines: tuple[tuple[str, object], ...], kernels: tuple[str, ...], device: int) -> dict:
    """Compile kernels/<name> with `defines` (NVRTC through CuPy), load it on `device`, and return
    {kernel name: cupy.RawKernel}. Cached: one build per file, geometry, dtype and device."""
    import cupy

    options = COMPILE_OPTIONS + tuple(define_flags(defines))
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source(name), options=options)
        try:
            # get_function compiles and loads the module now, so that nothing compiles later
            # (for instance during CUDA-graph capture, where it would fail)
            return {k: module.get_function(k) for k in kernels}
        except cupy.cuda.compiler.CompileException as e:
            # cuda_build.plan_kernels checks every limit the kernels assert, and CI compiles each
            # preset's plan with nvcc: reaching this is a bug of ours, not a user's mistake
            raise RunError(f"compiling {name} failed: {e}", "this is a bug in pagedcli's kernels; "
                           "please report it with the model's config.json") from None
