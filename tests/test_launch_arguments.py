"""How the CUDA backend hands a kernel its arguments when it launches through the driver's
cuLaunchKernelEx (sm_90+: cuda_launch.KernelArguments): a pointer to each value, each value the
bytes of its parameter's type. Checked on the host: no GPU needed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pagedcli.backends.cuda_launch import KernelArguments


def test_each_pointer_holds_its_arguments_bytes():
    args = (np.uint64(0x1234_5678_9ABC_DEF0), np.int32(-7), np.float32(1.5), np.int64(-2**40), np.float32(-0.0),
            np.uint32(2**32 - 1))
    arguments = KernelArguments()
    arguments.pack((np.uint64(2**64 - 1),) * 8)  # what an earlier launch left
    arguments.pack(args)
    pointers = list(arguments.pointers)[:len(args)]
    for p, a in zip(pointers, args):
        assert p % 8 == 0  # every value in an aligned slot of its own
        assert ctypes.string_at(p, a.itemsize) == a.tobytes()
    assert len(set(pointers)) == len(args)


def test_a_python_number_is_refused():
    """A Python int or float has no parameter type (CuPy would pass a float as a double); every call
    site passes numpy scalars, and a new one that does not is a bug found at once."""
    for bad in (3, 1.5, np.float64(1.5)):
        with pytest.raises(TypeError, match="numpy scalars"):
            KernelArguments().pack((np.int32(1), bad))
