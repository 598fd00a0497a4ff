"""The CUDA path of compressed weights, checked without a GPU: the arguments cuda_gemv.py launches
gemv.cu's kernels with (the dtype's, fp8's and the compressed gemvq4_/gemvq8_ ones) against each
kernel's parameters in the PTX nvcc makes of the plan's build (count, order, width and kind: a
pointer or int64 to 8 bytes, an int to a 32-bit integer, a float to .f32), as the launcher packs
them (test_launch_arguments.py); and cuda_quant.py's halves that need no GPU: which formats each
path takes, the group shift, the dense copy made by chunks, and the int4 GEMM's scales and zeros
against the reference's dequantization."""

from __future__ import annotations

import re
import shutil
import subprocess
import types

import numpy as np
import pytest
import torch

from pagedcli.backends import cuda_gemv
from pagedcli.backends.cuda_build import GEMV_MAX_ROWS, plan_kernels
from pagedcli.backends.cuda_compile import COMPILE_OPTIONS, define_flags, kernel_folder
from pagedcli.backends.cuda_launch import LaunchShapes
from pagedcli.backends.cuda_quant import (
    dense_form,
    gemv_unsupported,
    group_shift,
    int4mm_unsupported,
    pack_for_int4mm,
    quant_formats,
)
from pagedcli.core.batch import StepBatch
from pagedcli.core.geometry import CacheGeometry
from pagedcli.model.config import ModelConfig
from pagedcli.model.fp8 import quantize_weight
from pagedcli.model.presets import RANDOM_PRESETS
from pagedcli.model.quant import QuantWeight, pack_int4

NVCC = shutil.which("nvcc")
QUANT = ((4, 128, 3072, 2048), (8, 32, 2048, 2048))


def llama_1b() -> tuple[ModelConfig, CacheGeometry]:
    config = ModelConfig.from_file(RANDOM_PRESETS["llama-3.2-1b"])
    return config, CacheGeometry.build(config, torch.bfloat16, 16, num_blocks=64)


def ptx_params(file: str, defines) -> dict[str, list[str]]:
    """Each kernel of the build's PTX: its parameters' types (.u64, .u32, .f32, ...), in order."""
    folder = kernel_folder()
    done = subprocess.run([NVCC, *COMPILE_OPTIONS, "-arch=sm_90", "-ptx", "-o", "-", f"-I{folder}",
                           *define_flags(defines), str(folder / file)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-600:]
    return {name: re.findall(r"\.param\s+\.(\w+)", params)
            for name, params in re.findall(r"\.entry\s+(\w+)\s*\((.*?)\)", done.stdout, re.S)}


def fits(arg, ptx_type: str) -> bool:
    """A numpy scalar the launcher packs (its bytes) matches a PTX parameter's type."""
    bits = int(re.sub(r"\D", "", ptx_type))
    if isinstance(arg, np.floating):
        return ptx_type.startswith("f") and arg.itemsize * 8 == bits
    return isinstance(arg, np.integer) and not ptx_type.startswith("f") and arg.itemsize * 8 == bits


class FakeBackend:
    """What cuda_gemv asks of the CUDA backend, on the CPU: every tensor taken, launches recorded;
    rope_kv_args is CudaBackend's own over a CPU block table."""

    def __init__(self, config, geometry):
        from pagedcli.backends.cuda import CudaBackend

        self.dtype, self.vec, self.device_index = geometry.dtype, 8, 0
        self.num_heads, self.head_dim, self.kv_fp8 = config.num_heads, geometry.head_dim, False
        self.quant_bits = (4, 8)
        self.shapes = LaunchShapes.__new__(LaunchShapes)
        self.shapes.num_sms, self.shapes.vec = 132, 8
        self.store = types.SimpleNamespace(device_table=torch.zeros((4, config.num_layers, 8), dtype=torch.int32),
                                           pool=torch.zeros(geometry.pool_shape, dtype=geometry.dtype), kv_scales=None)
        self.cos = self.sin = torch.zeros((64, geometry.head_dim), dtype=geometry.dtype)
        self.rope_kv_args = types.MethodType(CudaBackend.rope_kv_args, self)
        self._layer_table = types.MethodType(CudaBackend._layer_table, self)
        self._kv_scale_args = types.MethodType(CudaBackend._kv_scale_args, self)
        self.launched = []

    def fusable(self, *tensors):
        return all(t.dtype == self.dtype for t in tensors)

    def launch(self, name, grid, block, args, shared_mem=0):
        self.launched.append((name, grid, block, args, shared_mem))


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA toolkit) is not on PATH")
def test_gemv_launch_arguments_match_every_kernels_parameters(monkeypatch):
    """Every kernel of gemv.cu's and gemv_quant.cu's builds for Llama-3.2-1B, launched by
    cuda_gemv.gemv at 1 and 2 rows (the model dtype's weight, an fp8 one, 4-bit and 8-bit
    QuantWeights, with and without offsets): one argument per parameter, each of its width and kind."""
    config, geometry = llama_1b()
    plan = plan_kernels(config, geometry, clusters=True, quant=QUANT)
    params = {}
    for file in ("gemv.cu", "gemv_quant.cu"):
        params |= ptx_params(file, plan.files[file][0])
    monkeypatch.setattr(cuda_gemv, "on_device", lambda be, t: True)
    be = FakeBackend(config, geometry)
    h, qkv_rows = config.hidden_size, config.q_dim + 2 * config.kv_dim
    gen = torch.Generator().manual_seed(0)

    def weights(n, k):
        dense = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        q4 = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
        scale = torch.rand(n, k // 128, generator=gen)
        yield dense
        yield quantize_weight(dense)
        yield QuantWeight(q4, scale, torch.randn(n, k // 128, generator=gen), 4, 128, "test")
        yield QuantWeight(torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8),
                          torch.rand(n, 1, generator=gen), None, 8, k, "test")

    batch = StepBatch.build(False, [0, 1], [[1], [1]], [5, 9], torch.device("cpu"))
    seen = set()
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x, norm = torch.randn(rows, h).to(torch.bfloat16), torch.ones(h, dtype=torch.bfloat16)
        residual = torch.zeros(rows, h, dtype=torch.bfloat16)
        for op, n in (("rms_norm_store", 1024), ("rms_norm_float", 1024), ("rms_norm_silu_mul", 1024),
                      ("plain_add", h), ("rms_norm_rope_kv", qkv_rows)):
            for weight in weights(n, h):
                rope = (0, StepBatch.build(False, [0], [[1]], [5], torch.device("cpu"))) if rows == 1 else (0, batch)
                out = cuda_gemv.gemv(be, op, x, weight, norm, 1e-5, residual=residual,
                                     rope_kv=rope if op.endswith("rope_kv") else None)
                assert out is not None, (op, rows, type(weight).__name__)
                name, grid, block, args, shared = be.launched[-1]
                assert name in params, f"{name}: no such kernel in the build"
                types_ = params[name]
                assert len(args) == len(types_), (name, len(args), types_)
                bad = [(i, a, t) for i, (a, t) in enumerate(zip(args, types_)) if not fits(a, t)]
                assert not bad, (name, bad)
                assert shared == rows * h * 2 and block == (256,) and grid[0] >= 1
                seen.add(name)
    assert {n for n in params if n.startswith("gemv")} == seen  # every kernel of both builds launched


def test_which_formats_each_path_takes():
    """gemv.cu: 4-bit groups of a power of two from 32, 8-bit from 16, or whole rows (of whole 16-byte
    loads); torch's int4 GEMM: 4-bit bf16 groups of 32 to 256, N in 8s and K in 32s on sm_80+."""
    assert gemv_unsupported(4, 32, 2048) is None and gemv_unsupported(4, 128, 576) is None
    assert gemv_unsupported(4, 576, 576) is None and gemv_unsupported(8, 16, 2048) is None
    assert "groups of 16" in gemv_unsupported(4, 16, 2048)
    assert "groups of 96" in gemv_unsupported(8, 96, 2016) and gemv_unsupported(8, 8, 64)
    assert "16-byte" in gemv_unsupported(4, 100, 100)
    assert int4mm_unsupported(4, 128, 3072, 2048, torch.bfloat16, True) is None
    assert int4mm_unsupported(4, 32, 8, 32, torch.bfloat16, True) is None
    for why, args in (("8-bit", (8, 32, 64, 64, torch.bfloat16, True)),
                      ("bfloat16", (4, 32, 64, 64, torch.float16, True)),
                      ("sm_80", (4, 32, 64, 64, torch.bfloat16, False)),
                      ("groups of 16", (4, 16, 64, 64, torch.bfloat16, True)),
                      ("in 8s", (4, 32, 60, 64, torch.bfloat16, True)),
                      ("in 32s", (4, 32, 64, 48, torch.bfloat16, True))):
        assert why in int4mm_unsupported(*args), (why, args)


def quant(n, k, bits, group, offset, seed=0) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scale = torch.randn(n, k // group, generator=gen) * 0.01
    return QuantWeight(q, scale, torch.randn(n, k // group, generator=gen) * 0.01 if offset else None, bits, group, "t")


def test_group_shift_takes_each_input_to_its_group():
    """gemv.cu's group of input k: k >> shift, for powers of two and for a row's one group (any K)."""
    for K, group in ((2048, 32), (2048, 128), (2048, 2048), (576, 576), (8640, 8640), (1024, 16)):
        w = quant(2, K, 8, group, False)
        k = torch.arange(K)
        assert torch.equal(k >> group_shift(w), k // group), (K, group)


def test_dense_copy_is_the_dequantized_weight_made_by_chunks(monkeypatch):
    """The dense copy past 2 rows: the reference's float32 dequantization rounded to the dtype, the
    same whatever the chunk of rows."""
    import pagedcli.backends.cuda_quant as cq

    for bits, group, offset in ((4, 32, True), (8, 16, False), (4, 64, False)):
        w = quant(37, 256, bits, group, offset)
        monkeypatch.setattr(cq, "DENSE_CHUNK_ROWS", 8)
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(dense_form(w, dtype), w.dequantize(torch.float32).to(dtype))


def test_int4mm_scales_and_zeros_give_the_references_weights():
    """What cuda_quant.int4mm_form hands torch's int4 GEMM besides the tiled values: bf16 scale and
    zero = offset + 8 * scale [groups, N, 2], which make (q - 8) * scale + zero the reference's
    q * scale + offset within bf16's rounding of scale and zero; and the nibble orders the probe
    tries (ours: the even column low)."""
    w = quant(16, 128, 4, 32, True)
    scale, offset = w.scale, w.offset
    zero = offset + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (int4mm_form's)
    assert sz.shape == (128 // 32, 16, 2)
    s = sz[..., 0].T.float().repeat_interleave(32, dim=1)
    z = sz[..., 1].T.float().repeat_interleave(32, dim=1)
    theirs = (w.values().float() - 8) * s + z
    ours = w.dequantize()
    bound = 2.0**-8 * ((w.values().float() - 8).abs() * s.abs() + z.abs())
    assert ((theirs - ours).abs() <= bound).all()
    values = w.values()
    assert torch.equal(pack_for_int4mm(values, False), w.q)
    high = pack_for_int4mm(values, True)
    assert torch.equal(high, (w.q << 4) | (w.q >> 4)) and torch.equal(high >> 4, values[:, 0::2].to(torch.uint8))


def test_quant_formats_lists_the_linear_layers_and_lm_head():
    layer = types.SimpleNamespace(qkv=quant(96, 64, 4, 32, True), o=torch.zeros(64, 64), post_norm=torch.ones(64),
                                  gate_up=quant(256, 64, 8, 64, False), down=quant(64, 128, 8, 128, False))
    weights = types.SimpleNamespace(layers=[layer, layer], lm_head=quant(100, 64, 4, 64, False))
    assert quant_formats(weights) == ((4, 32, 96, 64), (4, 64, 100, 64), (8, 64, 256, 64), (8, 128, 64, 128))
    weights.layers, weights.lm_head = [types.SimpleNamespace(qkv=torch.zeros(2, 2))], torch.zeros(2, 2)
    assert quant_formats(weights) == ()


# --- gemv.cu's arithmetic, mirrored in numpy's float32 (IEEE, round to nearest: __fmul_rn, __fadd_rn) ---

def as_float(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def kernel_int4(words: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """gemv.cu's dequantize_int4 on uint32 words (8 nibbles each, nibble n = weight n), line for line:
    nibble n < 5 in place at bit 4n under 2^23's exponent, less 2^23, times scale * 16^-n; 5..7 after
    `word >> 12`."""
    s = [scale * np.float32(2.0 ** (-4 * j)) for j in range(5)]
    high = words >> np.uint32(12)
    out = []
    for n in range(8):
        at = n if n < 5 else n - 3
        bits = (words if n < 5 else high) & np.uint32(0xF << (4 * at))
        q = as_float(np.uint32(0x4B000000) | bits) - np.float32(8388608.0)
        product = q * s[at]
        out.append(product if offset is None else product + offset)
    return np.stack(out, axis=-1)


def kernel_int8(words: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """gemv.cu's dequantize_int8 on uint32 words (4 int8 values each), line for line."""
    s0, s1 = scale, scale * np.float32(2.0**-8)
    high = words >> np.uint32(16)
    out = []
    for b in range(4):
        at = b & 1
        bits = ((words if b < 2 else high) & np.uint32(0xFF << (8 * at))) ^ np.uint32(0x4B000000 | (0x80 << (8 * at)))
        q = as_float(bits) - np.float32(8421376.0 if at else 8388736.0)
        product = q * (s1 if at else s0)
        out.append(product if offset is None else product + offset)
    return np.stack(out, axis=-1)


@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_dequantization_is_the_references_bit_for_bit(bits, offset):
    """Every value a byte can hold (each nibble at each of a word's 8 places), scales of both signs
    over 2^-24 .. 2^4 (fp16's smallest scale and up): gemv.cu's exponent tricks give
    QuantWeight.dequantize's float32 weights bit for bit."""
    gen = torch.Generator().manual_seed(1)
    K, group = 64, 32
    n = 4096
    if bits == 4:
        values = torch.randint(0, 16, (n, K), generator=gen)
        values[:16, :] = torch.arange(16)[:, None]  # each value at every place
        q = pack_int4(values)
    else:
        q = torch.randint(-128, 128, (n, K), generator=gen).to(torch.int8)
        q[:256, :] = torch.arange(-128, 128, dtype=torch.int8)[:, None]
    exponent = torch.randint(-24, 5, (n, K // group), generator=gen).float()
    scale = (torch.rand(n, K // group, generator=gen) + 1) * 2.0**exponent * (torch.randint(0, 2, (n, 1), generator=gen) * 2 - 1)
    off = torch.randn(n, K // group, generator=gen) if offset else None
    weight = QuantWeight(q, scale, off, bits, group, "t")
    want = weight.dequantize().numpy().view(np.uint32)
    words = q.numpy().view(np.uint32)  # little-endian: byte 0 lowest, as a GPU's 32-bit load
    per_group = group // (8 if bits == 4 else 4)  # words a group
    s = np.repeat(scale.numpy(), per_group, axis=1)
    o = None if off is None else np.repeat(off.numpy(), per_group, axis=1)
    got = (kernel_int4 if bits == 4 else kernel_int8)(words, s, o).reshape(n, K)
    assert np.array_equal(got.view(np.uint32), want)


@pytest.mark.parametrize("swz", [1, 3, 7])
def test_staged_input_swizzle_is_a_permutation_without_bank_conflicts(swz):
    """gemv.cu's staged_slot, mirrored: a permutation of each row's 16-byte vectors (K a whole number
    of a lane's SWZ + 1), and for a lane's j-th vector the 8 lanes of a quarter-warp (whose loads lie
    SWZ + 1 vectors apart) fall on 8 distinct 16-byte bank groups."""
    def slot(v):
        return v ^ ((v >> 3) & swz)

    V = swz + 1
    vecs = 32 * V * 3
    assert sorted(slot(v) for v in range(vecs)) == list(range(vecs))
    for base in (0, 32 * V, 64 * V):  # a tile's first vector for unroll steps 0, 1, 2
        for quarter in range(4):
            for j in range(V):
                groups = {slot(base + V * lane + j) % 8 for lane in range(8 * quarter, 8 * quarter + 8)}
                assert len(groups) == 8, (swz, base, quarter, j)


def test_int4mm_probe_says_why_where_torch_has_no_int4_gemm():
    """Where the op does not run (here: the CPU, which has only the _for_cpu variants), the probe
    gives no order and one line of why: the backend then names the dense copies in its notice."""
    from pagedcli.backends.cuda_quant import int4mm_probe

    order, why = int4mm_probe(torch.device("cpu"))
    assert order is None and "int4 GEMM" in why and "\n" not in why
