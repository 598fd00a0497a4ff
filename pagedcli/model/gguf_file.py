"""A GGUF file's header read with every count bounded: the metadata (key -> value) and each
tensor's name, quant type, shape and bytes, the tensors themselves left in the memory-mapped file.

The `gguf` package's GGUFReader walks the counts the file states in Python loops without checking
them against the file's size (an array length of 2**40 loops that many times), so the header is read
here: every length, count and dimension is checked against the bytes that are left before anything
is allocated or looped over, and a tensor's bytes must lie inside the file. The package supplies
the quant types' names and block sizes (and the tests' reference dequantizer and writer).

Layout (GGUF v2 and v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata count;
the metadata (string key, u32 type, value); the tensor infos (string name, u32 dims, u64 each
dimension, innermost first, u32 type, u64 offset into the data section); the data section, at the
next multiple of general.alignment (32 unless given).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedcli.core.errors import RunError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16  # a metadata key or tensor name longer than this is not a real file's
# GGUF's value types: id -> (name, numpy dtype); 8 is a string, 9 an array
SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str  # the quant type's name: F32, Q4_K, ...
    shape: tuple[int, ...]  # outermost first, as torch shapes go: [out, in] for a linear layer
    offset: int  # absolute, into the file
    nbytes: int


class GGUFFile:
    """The header of the GGUF file at `path`; `raw(name)` the bytes of one tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 24:
                    raise self.broken(f"it holds {size} bytes, shorter than a GGUF header")
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise RunError(f"{self.path} could not be read ({e.strerror or e})") from None
        self.size, self.pos = size, 0
        if self.map[:4] != MAGIC:
            raise RunError(f"{self.path} is not a GGUF file (it does not start with GGUF)",
                           "pass a .gguf file from llama.cpp, ollama or the Hub")
        self.pos = 4
        version = self.u32()
        if version not in VERSIONS:
            raise RunError(f"{self.path}: GGUF version {version} is not supported", "pagedcli reads GGUF versions 2 and 3")
        tensor_count, kv_count = self.u64(), self.u64()
        # each entry takes at least this many bytes: counts beyond what the file holds are refused unread
        self.bound(kv_count, 8 + 4 + 1, "metadata entries")
        self.bound(tensor_count, 8 + 4 + 4 + 8, "tensors")
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self.string("a metadata key", MAX_KEY_BYTES)
            self.metadata[key] = self.value(self.u32(), key)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", 32)
        if not (isinstance(alignment, int) and 0 < alignment <= 1 << 20 and alignment & (alignment - 1) == 0):
            raise self.broken(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, kind, shape, offset, nbytes in infos:
            if name in self.tensors:
                raise self.broken(f"tensor {name} is listed twice")
            if start + offset + nbytes > size:
                raise RunError(f"{self.path}: tensor {name}'s {nbytes} bytes end past the file's {size} "
                               f"(is the file truncated?)", "download the file again")
            self.tensors[name] = TensorInfo(name, kind, shape, start + offset, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 (a view of the mapped file, read-only)."""
        t = self.tensors[name]
        return np.frombuffer(self.map, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    # --- reading the header ---------------------------------------------------------------------
    def broken(self, why: str) -> RunError:
        return RunError(f"{self.path}: {why}", "the file is damaged or truncated; download it again")

    def take(self, n: int) -> int:
        """The position of the next `n` bytes, which must lie inside the file."""
        if n > self.size - self.pos:
            raise self.broken(f"the header ends past the end of the file (at byte {self.pos} of {self.size})")
        at, self.pos = self.pos, self.pos + n
        return at

    def u32(self) -> int:
        return struct.unpack_from("<I", self.map, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.map, self.take(8))[0]

    def bound(self, count: int, each: int, what: str) -> None:
        if count * each > self.size - self.pos:
            raise self.broken(f"it says it holds {count} {what}, more than its {self.size} bytes can")

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64()
        if limit is not None and n > limit:
            raise self.broken(f"{what} of {n} bytes")
        at = self.take(n)
        try:
            return self.map[at:at + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.broken(f"{what} at byte {at} is not UTF-8 text") from None

    def value(self, kind: int, key: str):
        if kind in SCALARS:
            dtype = np.dtype(SCALARS[kind])
            v = np.frombuffer(self.map, dtype=dtype.newbyteorder("<"), count=1, offset=self.take(dtype.itemsize))[0]
            return v.item()
        if kind == STRING:
            return self.string(f"metadata {key}")
        if kind != ARRAY:
            raise self.broken(f"metadata {key} has value type {kind}, which GGUF does not define")
        item, count = self.u32(), self.u64()
        if item in SCALARS:
            dtype = np.dtype(SCALARS[item]).newbyteorder("<")
            self.bound(count, dtype.itemsize, f"values in metadata {key}")
            return np.frombuffer(self.map, dtype=dtype, count=count, offset=self.take(count * dtype.itemsize)).copy()
        if item == STRING:
            self.bound(count, 8, f"strings in metadata {key}")
            return [self.string(f"an entry of metadata {key}") for _ in range(count)]
        raise self.broken(f"metadata {key} is an array of type {item} (arrays of arrays are not read)")

    def tensor_info(self) -> tuple[str, str, tuple[int, ...], int, int]:
        name = self.string("a tensor name", MAX_KEY_BYTES)
        n_dims = self.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.broken(f"tensor {name} has {n_dims} dimensions (GGUF's are 1 to {MAX_DIMS})")
        dims = [self.u64() for _ in range(n_dims)]
        kind_id, offset = self.u32(), self.u64()
        try:
            kind = GGMLQuantizationType(kind_id)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise self.broken(f"tensor {name} has type {kind_id}, which ggml does not define") from None
        count = 1
        for d in dims:  # each dimension at least 1, and all of them within the file's bytes
            if d < 1 or d > self.size:
                raise self.broken(f"tensor {name} has dimensions {dims}")
            count *= d
        if dims[0] % block:
            raise self.broken(f"tensor {name} ({kind.name}) has rows of {dims[0]} values, not whole blocks of {block}")
        nbytes = count // block * block_bytes
        if nbytes > self.size:
            raise RunError(f"{self.path}: tensor {name} ({kind.name}, {dims}) needs {nbytes} bytes, more than the "
                           f"file's {self.size} (is the file truncated?)", "download the file again")
        return name, kind.name, tuple(reversed(dims)), offset, nbytes
