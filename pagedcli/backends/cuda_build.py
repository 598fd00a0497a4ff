"""What our CUDA kernels are compiled with for one model, and which of them can serve it.

The plan is pure Python (no CuPy, no GPU): the CUDA backend builds from it
(`cuda_compile.compile_kernels`, through CuPy), and the CPU tests compile the same plan with `nvcc`
for every preset geometry, so a geometry that would not compile is found in CI, not by a user.
Every limit a kernel asserts at compile time (`static_assert` in the .cu files) is checked here
first; where a kernel cannot serve a shape, the plan says which op runs as torch ops instead, and
why, in one line the user sees.

The tuning constants are written here only; the .cu files receive them as -D defines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pagedcli.backends.cuda_compile import Defines
from pagedcli.backends.cuda_quant import plan_notes
from pagedcli.core.batch import NOT_FINITE
from pagedcli.core.fp8 import FP8_DTYPE
from pagedcli.core.geometry import CacheGeometry
from pagedcli.model.config import ModelConfig
from pagedcli.model.fp8 import FP8_MMA_MULTIPLE, W8A16_MAX_ROWS

PARTITION_SIZE = 512  # tokens per split-KV chunk of the decode kernel (a multiple of every block size)
ATTN_THREADS = 128  # threads of a decode CTA
ATTN_STAGES = 4  # load steps of the decode kernel in flight per lane (cp.async ring in shared memory)
# Per decode lane: K/V rows per load step, and the CTAs per SM the registers must allow; for CTAs
# serving <= 4 query heads, and more (q and the sums then take more registers).
UNROLL_SMALL_Q, MIN_CTAS_SMALL_Q = 4, 5
UNROLL_LARGE_Q, MIN_CTAS_LARGE_Q = 2, 3
# Query heads one decode CTA serves (8 was slower at GQA 8: docs/performance-log.md, "Every preset").
MAX_HEADS_PER_CTA = 4
# An fp8 pool's decode loads: 8 e4m3 bytes a lane, as many elements as a 16-byte load of bf16, so the
# lane's q slice and sums are the same size (16-byte loads, 16 elements a lane, spill at
# MIN_CTAS_SMALL_Q: ptxas gives 96 registers and ~270 bytes of spill loads at Llama-3.2-1B).
ATTN_FP8_VEC_BYTES = 8
ATTN_STATIC_SHARED = 48 * 1024  # static shared memory a CTA may declare (CUDA's limit)
# Cap on decode CTAs (per SM) when choosing the number of splits (the splits a short context does
# not need still launch CTAs that find no work and leave: docs/performance-log.md, "What won").
SPLIT_CTAS_PER_SM = 4
MIN_SPAN = 128  # fewest context tokens a decode split takes (shorter ones cost more than they save)
# Small batches on sm_90+: splits in thread-block clusters of this many CTAs, which merge in shared
# memory (paged_attention.cu); cheap enough a merge that a split may take as few tokens as this.
ATTN_CLUSTER = 8  # the largest portable cluster
CLUSTER_MIN_SPAN = 64
# The prefill kernel (paged_prefill.cu, FlashAttention-2's tiles on tensor cores): warps per CTA,
# 16-row mma tiles per warp (two share each K/V fragment read from shared memory; at head_dim
# over 64 their accumulators would not fit in registers), keys per tile, and the largest head_dim
# the accumulators hold.
PREFILL_WARPS = 4
PREFILL_M_TILES_SMALL_D = 2  # head_dim <= 64
PREFILL_BLOCK_N = 64
PREFILL_MAX_HEAD_DIM = 256
# Where a step's prefill tiles are too few to fill the GPU (a short chunk after a long prefix), the
# longest ones' keys are cut into parts (cuda_launch.key_parts) until the step has as many CTAs as
# the GPU holds at once: each part at least PREFILL_SPLIT_MIN_TILES key tiles long, at most
# PREFILL_MAX_PARTS parts a tile. Off: keys never split (A/B runs).
PREFILL_SPLIT = True
PREFILL_SPLIT_MIN_TILES = 8
PREFILL_MAX_PARTS = 16
# sm_90+: a whole prompt of cudnn_prefill.CUDNN_MIN_TOKENS or more takes cuDNN's fused attention
# (wgmma) instead of paged_prefill.cu; off: paged_prefill.cu serves every prompt (A/B runs)
CUDNN_PREFILL = True
# Decode attention on tensor cores (paged_decode_mma.cu), for batches whose (sequence, kv head)s
# fill the GPU with one CTA each (no split): warps per CTA, keys per warp tile, tiles in each warp's
# cp.async ring.
DECODE_MMA_KERNEL = True  # off: paged_attention.cu at every batch (tools/tune_decode.py's A/B variant)
DECODE_MMA_WARPS = 4
DECODE_MMA_KEYS = 16
DECODE_MMA_STAGES = 2
DECODE_MMA_MAX_GQA = 16  # the group's query heads are the rows of one 16-row mma tile
# sm_90+ with a CUDA 12.3+ driver: each of our kernels may start while the one before it still runs
# (programmatic dependent launch, kernels/common.cuh), so that a chain of short kernels overlaps each
# launch and first load with the previous kernel's end; off: every launch waits for the previous
# kernel to finish.
PROGRAMMATIC_LAUNCH = True
H100_MAX_SHARED = 227 * 1024  # shared memory a CTA may opt in to on sm_90 (the plan's default GPU)
KV_WRITE_THREADS = 128
# rope_write_kv reads and writes 16-byte vectors where its grid then has at least this many CTAs an
# SM; with fewer (decode at batch 64 and below on the H200), the kernel of one element a thread,
# with 8 times the threads, finishes sooner
# (docs/performance-log.md, "RoPE and the K/V write in 16-byte vectors, at large grids")
ROPE_VEC_MIN_CTAS_PER_SM = 2
SILU_THREADS = 256
ARGMAX_THREADS = 256
ARGMAX_CHUNK = 4096  # logits per argmax CTA
# gemv.cu is compiled for these row counts; a batch takes the next one up. Larger batches: cuBLAS,
# which is faster from 3 rows on, while gemv.cu wins at 1 and 2 (docs/performance-log.md,
# "Each GEMM at batch 1").
GEMV_ROW_BUCKETS = (1, 2)
GEMV_MAX_ROWS = GEMV_ROW_BUCKETS[-1]
GEMV_THREADS = 256
GEMV_UNROLL = 4  # 16-byte loads per lane per tile (and as many for the next tile, in flight meanwhile)
GEMV_MIN_CTAS = 4  # CTAs per SM the registers must allow
GEMV_CTAS_PER_SM = 4  # CTAs launched per SM, each looping over its rows: one wave
GEMV_SPLITS = (1, 2, 4)  # warps that may share a row (each over a slice of K) when rows are too few to fill the GPU
GEMV_MAX_SHARED = 64 * 1024  # bytes of staged input per CTA (rows x K); more: cuBLAS
GEMV_EVICT_FIRST = 1  # weight loads ask L2 to evict their lines first (gemv.cu says why)
# gemv_quant.cu (compressed weights: cuda_quant.py): CTAs per SM its registers allow, and launched.
# Dequantizing a 16-byte load's 32 weights (and its group's scale and offset, double-buffered like
# the values) takes more registers than the dtype's 8: at 4 CTAs (64 registers) ptxas spills 100 to
# 270 bytes a thread, at 3 (80) at most 44 bytes in the 2-row kernels, at 2 none (sm_90, CUDA 13). A
# tunable until measured: 3 CTAs of 8 warps keep 6 KB a warp in flight.
GEMV_QUANT_CTAS_PER_SM = 3
VEC_BYTES = 16  # the kernels' vector width (uint4)
# Kernels written where no GPU could be had to run them: a sliding window in the three attention
# kernels, gemv_quant.cu's compressed GEMVs. They pass every check a CPU allows (built for every
# geometry, their index arithmetic emulated), but until their GPU tests have run, a model that needs
# them takes the path it took before (torch attention; the compressed weights' cuBLAS path), with a
# notice. This variable set to 1 uses them (the GPU tests set it: tests/conftest.py).
UNVERIFIED_KERNELS_VAR = "PAGEDCLI_UNVERIFIED_KERNELS"
WARP_SIZE = 32

DTYPE_DEFINES = {torch.bfloat16: "DTYPE_BF16", torch.float16: "DTYPE_F16", torch.float32: "DTYPE_F32"}
# The pool's element where it is not the model's (`kv_cache_dtype` fp8): geometry.cuh's kv_t, and
# the k_scale/v_scale parameters of the kernels that touch the pool.
KV_DTYPE_DEFINES = {FP8_DTYPE: "KV_FP8"}
GEMV_OPS = ("rms_norm_store", "rms_norm_float", "rms_norm_silu_mul", "plain_add", "rms_norm_rope_kv")
QUANT_BITS = (4, 8)  # gemv_quant.cu's compressed weights (model/quant.py)
# fp8 weights on more rows (cuda_fp8_gemm.py): the activations' per-row quantization, then torch._scaled_mm
FP8_QUANT_KERNELS = ("quantize_rows_vec", "quantize_rows_scalar", "rms_norm_quantize_rows_vec",
                     "rms_norm_quantize_rows_scalar")


def gemv_kernel_names():
    """The kernels gemv.cu defines: one per row bucket and fused op, each in the model dtype (gemv_)
    and for fp8 weights (gemv8_): its GEMV_KERNELS macro."""
    for rows in GEMV_ROW_BUCKETS:
        for op in GEMV_OPS:
            yield f"gemv_{rows}_{op}"
            yield f"gemv8_{rows}_{op}"


def unverified_kernels() -> bool:
    """Whether kernels not yet run on a GPU are used (UNVERIFIED_KERNELS_VAR)."""
    return os.environ.get(UNVERIFIED_KERNELS_VAR) == "1"


def quant_kernel_names(bits: tuple[int, ...] = QUANT_BITS):
    """gemv_quant.cu's kernels for weights of these bits: gemvq<bits>_<rows>_<op> (its GEMVQ_KERNELS)."""
    for b in bits:
        for rows in GEMV_ROW_BUCKETS:
            for op in GEMV_OPS:
                yield f"gemvq{b}_{rows}_{op}"


def heads_per_cta(gqa: int) -> int:
    """Query heads a decode CTA serves: the largest divisor of the GQA group <= MAX_HEADS_PER_CTA."""
    return max(d for d in range(1, min(gqa, MAX_HEADS_PER_CTA) + 1) if gqa % d == 0)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class AttentionShape:
    """How paged_attention.cu lays one geometry out: the Python mirror of its compile-time sizes
    (the nvcc test compiles every preset, so the two cannot drift apart unnoticed)."""

    head_dim: int
    itemsize: int  # the pool's element: the model dtype's, or 1 for an fp8 pool
    heads_per_cta: int
    block_size: int
    unroll: int
    kv_fp8: bool = False

    @property
    def row_bytes(self) -> int:  # `itemsize`: the pool's element (1 for fp8)
        return self.head_dim * self.itemsize

    @property
    def vec_bytes(self) -> int:
        """The kernel's load width (ATTN_VEC_BYTES): 16 bytes, or 8 for a row that is not whole
        16-byte vectors (head_dim 100 in bf16) and for an fp8 pool (ATTN_FP8_VEC_BYTES); 0 when
        none divides the row."""
        return row_vec_bytes(self.row_bytes, ATTN_FP8_VEC_BYTES if self.kv_fp8 else VEC_BYTES)

    @property
    def row_vecs(self) -> int:
        return self.row_bytes // self.vec_bytes

    def shared_bytes(self) -> int:
        """Static shared memory of the decode kernel's cluster variant (the larger of the two)."""
        rows_per_warp = WARP_SIZE // next_pow2(self.row_vecs)
        warps = ATTN_THREADS // WARP_SIZE
        score_floats = -(-self.heads_per_cta * (PARTITION_SIZE + rows_per_warp) // 4) * 4
        ring_floats = ATTN_STAGES * self.unroll * ATTN_THREADS * self.vec_bytes // 4
        acc_floats = warps * self.heads_per_cta * self.head_dim
        smem_floats = max(score_floats + ring_floats, acc_floats)
        heads = self.heads_per_cta
        per_cta = smem_floats * 4 + PARTITION_SIZE // self.block_size * 4 + (2 * warps + 4) * heads * 4 + 4
        cluster_merge = (heads * self.head_dim + 2 * heads + 2 * heads + ATTN_CLUSTER * heads) * 4
        return per_cta + cluster_merge

    def unsupported(self) -> str | None:
        """Why the decode kernel cannot serve this shape, or None."""
        if not self.vec_bytes:
            return (f"a head's row is {self.row_bytes} bytes ({self.head_dim} x {self.itemsize}), "
                    f"not a whole number of {VEC_BYTES // 2}-byte loads")
        if self.row_vecs > WARP_SIZE:
            return f"a head's row is {self.row_bytes} bytes, more than one warp's {WARP_SIZE * self.vec_bytes}"
        if self.shared_bytes() > ATTN_STATIC_SHARED:
            return f"it would need {self.shared_bytes()} bytes of shared memory, over {ATTN_STATIC_SHARED}"
        return None


def row_vec_bytes(row_bytes: int, widest: int = VEC_BYTES) -> int:
    """The widest load (16 or 8 bytes, at most `widest`) that a head's row is a whole number of; 0
    when none is."""
    return next((v for v in (VEC_BYTES, VEC_BYTES // 2) if v <= widest and row_bytes % v == 0), 0)


def prefill_rows(head_dim: int) -> int:
    """Query rows a prefill CTA takes (its PREFILL_BLOCK_M)."""
    return 16 * PREFILL_WARPS * prefill_m_tiles(head_dim)


def prefill_m_tiles(head_dim: int) -> int:
    return PREFILL_M_TILES_SMALL_D if head_dim <= 64 else 1


def prefill_shared_bytes(head_dim: int, itemsize: int, kv_fp8: bool = False) -> int:
    """paged_prefill.cu's dynamic shared memory (its SMEM_BYTES): the Q tile and two K and two V
    tiles, rows of the head dim padded to the mma's 16 plus 8 elements of `itemsize` (the model
    dtype's); for an fp8 pool one K and one V tile, and two staging buffers of e4m3 K and V tiles
    (unpadded, a byte an element)."""
    row = (-(-head_dim // 16) * 16 + 8) * itemsize
    if kv_fp8:
        return (prefill_rows(head_dim) + 2 * PREFILL_BLOCK_N) * row + 4 * PREFILL_BLOCK_N * head_dim
    return (prefill_rows(head_dim) + 4 * PREFILL_BLOCK_N) * row


def prefill_unsupported(geometry: CacheGeometry, tensor_cores: bool, max_shared: int) -> str | None:
    """Why paged_prefill.cu cannot serve this geometry on a GPU whose CTAs may have `max_shared`
    bytes of shared memory, or None."""
    dtype = str(geometry.dtype).removeprefix("torch.")
    if geometry.dtype == torch.float32:
        return "float32: the tensor-core kernel takes bfloat16 or float16"
    if not tensor_cores:
        return "the GPU is older than sm_80 (no bf16/fp16 mma.sync)"
    rows_ok = row_vec_bytes(geometry.head_dim * geometry.dtype.itemsize) and row_vec_bytes(geometry.head_dim * geometry.itemsize)
    if not rows_ok or geometry.head_dim > PREFILL_MAX_HEAD_DIM:
        pool = " with an fp8 pool" if geometry.kv_fp8 else ""
        return (f"head_dim {geometry.head_dim} in {dtype}{pool}: the kernel takes rows of whole 8-byte loads, "
                f"head_dim at most {PREFILL_MAX_HEAD_DIM}")
    need = prefill_shared_bytes(geometry.head_dim, geometry.dtype.itemsize, geometry.kv_fp8)
    if need > max_shared:
        return f"head_dim {geometry.head_dim}: a CTA needs {need} bytes of shared memory, this GPU allows {max_shared}"
    return None


def decode_mma_shared_bytes(head_dim: int, itemsize: int, kv_fp8: bool = False) -> int:
    """paged_decode_mma.cu's dynamic shared memory (its SMEM_BYTES): each warp's ring of K and V
    tiles in the model dtype (`itemsize`), rows of the head dim padded to the mma's 16 plus 8
    elements; with an fp8 pool the ring's tiles are e4m3 rows (head_dim bytes), and each warp has
    one K and one V tile in the model dtype besides."""
    row = (-(-head_dim // 16) * 16 + 8) * itemsize
    tiles = 2 * DECODE_MMA_KEYS * row  # a K and a V tile the mma reads
    if kv_fp8:
        return DECODE_MMA_WARPS * (DECODE_MMA_STAGES * 2 * DECODE_MMA_KEYS * head_dim + tiles)
    return DECODE_MMA_WARPS * DECODE_MMA_STAGES * tiles


def decode_mma_unsupported(config: ModelConfig, geometry: CacheGeometry, tensor_cores: bool,
                           max_shared: int) -> str | None:
    """Why paged_decode_mma.cu cannot serve this geometry (paged_attention.cu then serves every
    batch), or None."""
    if geometry.dtype == torch.float32:
        return "the tensor-core decode kernel runs on bf16/fp16 tensor cores"
    if not tensor_cores:
        return "the GPU is older than sm_80"
    gqa = config.num_heads // config.num_kv_heads
    if gqa > DECODE_MMA_MAX_GQA:
        return f"{gqa} query heads a kv head, over one mma tile's {DECODE_MMA_MAX_GQA} rows"
    if not row_vec_bytes(geometry.head_dim * geometry.itemsize) or geometry.head_dim > PREFILL_MAX_HEAD_DIM:
        return f"head_dim {geometry.head_dim}: rows of whole 8-byte loads, at most {PREFILL_MAX_HEAD_DIM}"
    if decode_mma_shared_bytes(geometry.head_dim, geometry.dtype.itemsize, geometry.kv_fp8) > max_shared:
        return f"head_dim {geometry.head_dim}: over this GPU's {max_shared} bytes of shared memory a CTA"
    return None


@dataclass
class KernelPlan:
    """Per .cu file: the -D defines and the kernels to load. `fallbacks`: op -> why it runs as torch
    ops on the GPU (one line each, shown to the user once)."""

    files: dict[str, tuple[Defines, tuple[str, ...]]] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    heads_per_cta: int = 1
    attn_min_ctas: int = MIN_CTAS_SMALL_Q
    prefill_shared: int = 0  # dynamic shared memory of a prefill CTA
    prefill_rows: int = 0  # query rows a prefill CTA takes
    decode_mma_shared: int = 0  # dynamic shared memory of a paged_decode_mma.cu CTA (0: not built)
    fp8_gemm: bool = False  # fp8 weights over W8A16_MAX_ROWS rows on fp8 tensor cores (cuda_fp8_gemm.py)
    rope_vec: int = 1  # elements a thread of rope_write_kv_vec takes (kv_write.cu's ROPE_VEC)

    @property
    def attention_decode(self) -> bool:
        return "paged_attention.cu" in self.files

    @property
    def attention_prefill(self) -> bool:
        return "paged_prefill.cu" in self.files


def fp8_fallback_note(why: str) -> str:
    return (f"`quantization` fp8 over {W8A16_MAX_ROWS} rows (prefill, larger batches): {why}; torch's float32 "
            "product of the per-row quantized activations and the fp8 weights, the LM head's too (model/fp8.py)")


def fp8_gemm_unsupported(config: ModelConfig, fp8_tensor_cores: bool) -> str | None:
    """Why the fp8 tensor-core GEMMs (cuda_fp8_gemm.py) cannot serve this model's linear layers, or None."""
    if not fp8_tensor_cores:
        return "this GPU has no fp8 tensor cores (sm_89 and newer have them)"
    dims = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "q_dim": config.q_dim, "kv_dim": config.kv_dim}
    odd = [f"{name} {d}" for name, d in dims.items() if d % FP8_MMA_MULTIPLE]
    return f"fp8 GEMMs need multiples of {FP8_MMA_MULTIPLE}, not {', '.join(odd)}" if odd else None


def plan_kernels(config: ModelConfig, geometry: CacheGeometry, clusters: bool, tensor_cores: bool = True,
                 max_shared: int = H100_MAX_SHARED, fp8_weights: bool = False,
                 fp8_tensor_cores: bool = True, quant: tuple[tuple[int, int, int, int], ...] = ()) -> KernelPlan:
    """The kernels for `config` with the cache of `geometry` (its dtype is the model's; its pool's
    may be fp8: KV_DTYPE_DEFINES) on a GPU with thread-block clusters (`clusters`: sm_90+),
    bf16/fp16 mma.sync (`tensor_cores`: sm_80+), fp8 tensor cores (`fp8_tensor_cores`: sm_89+)
    and `max_shared` bytes of shared memory a CTA may opt in to; `fp8_weights`: the linear layers
    (and the LM head) are Fp8Weights (model/fp8.py); `quant`: the (bits, group, out, in) of the
    QuantWeights among them (cuda_quant.quant_formats; model/quant.py)."""
    if geometry.dtype not in DTYPE_DEFINES:
        raise ValueError(f"no CUDA kernels for {geometry.dtype}")
    dtype = ((DTYPE_DEFINES[geometry.dtype], None),)
    pool = ((KV_DTYPE_DEFINES[geometry.kv_dtype], None),) if geometry.kv_fp8 else ()
    model = tuple(sorted(geometry.defines().items())) + (("NUM_HEADS", config.num_heads),) + dtype + pool
    plan = KernelPlan()
    if fp8_weights:  # gemv.cu's gemv8_ kernels serve decode batches up to GEMV_MAX_ROWS; more rows, W8A8
        why = fp8_gemm_unsupported(config, fp8_tensor_cores)
        plan.fp8_gemm = why is None
        if why is None:
            plan.files["fp8_quant.cu"] = (dtype, FP8_QUANT_KERNELS)
        else:
            plan.fallbacks["linear layers"] = fp8_fallback_note(why)
    vec = VEC_BYTES // geometry.dtype.itemsize  # 16-byte vectors where a head's half is whole vectors
    plan.rope_vec = vec if geometry.head_dim // 2 % vec == 0 else 1
    plan.files["kv_write.cu"] = (model + (("ROPE_VEC", plan.rope_vec),), ("rope_write_kv_vec", "rope_write_kv_scalar"))
    plan.files["elementwise.cu"] = (dtype, ("rms_norm_vec", "rms_norm_scalar", "add_rms_norm_vec",
                                            "add_rms_norm_scalar", "silu_mul_vec", "silu_mul_scalar"))
    gemv = model + (("GEMV_THREADS", GEMV_THREADS), ("GEMV_UNROLL", GEMV_UNROLL), ("GEMV_MIN_CTAS", GEMV_MIN_CTAS),
                    ("GEMV_EVICT_FIRST", GEMV_EVICT_FIRST))
    plan.files["gemv.cu"] = (gemv, tuple(gemv_kernel_names()))
    if quant:  # compressed weights: gemv_quant.cu at 1 and 2 rows, torch's int4 GEMM or a dense copy beyond
        bits = tuple(sorted({f[0] for f in quant}))
        plan.fallbacks.update(plan_notes(quant, geometry.dtype, tensor_cores))
        if unverified_kernels():
            plan.files["gemv_quant.cu"] = (gemv + (("GEMV_QUANT_MIN_CTAS", GEMV_QUANT_CTAS_PER_SM),),
                                           tuple(quant_kernel_names(bits)))
        else:
            plan.fallbacks["compressed linear layers at 1 and 2 rows"] = (
                f"gemv_quant.cu awaits its GPU tests ({UNVERIFIED_KERNELS_VAR}=1 uses it): the path of more rows")
    plan.files["argmax.cu"] = (dtype + (("ARGMAX_THREADS", ARGMAX_THREADS), ("NOT_FINITE", NOT_FINITE)),
                               ("argmax_rows", "argmax_rows_widen"))

    # what gemv.cu and kv_write.cu have no epilogue or table for (the CUDA backend checks the same)
    biased = {(True, True): "q/k/v and o projections", (True, False): "q/k/v projections",
              (False, True): "o projection"}.get((config.qkv_bias, config.o_bias))
    if biased:
        plan.fallbacks[biased] = "attention biases: gemv.cu adds no bias; cuBLAS, then torch's add"
    if config.qk_norm:
        plan.fallbacks["q/k head norms"] = ("gemv.cu's qkv epilogue norms no heads: cuBLAS, then RMSNorm kernels, then "
                                            "RoPE and the K/V write")
    if config.mlp_bias:
        plan.fallbacks["gate/up and down projections"] = "mlp_bias: gemv.cu adds no bias; cuBLAS, then torch's add"
    if config.rope_type == "dynamic":
        plan.fallbacks["RoPE and the K/V write"] = ("dynamic NTK RoPE rotates each token by its sequence's length, "
                                                    "not by one fixed table")

    # the attention kernels read only a sliding window's keys (0: none), never the blocks behind it
    window = (("SLIDING_WINDOW", config.sliding_window or 0),)
    held = (f"sliding_window {config.sliding_window}: our kernels' window awaits its GPU tests "
            f"({UNVERIFIED_KERNELS_VAR}=1 uses it)" if config.sliding_window and not unverified_kernels() else None)
    why = held or prefill_unsupported(geometry, tensor_cores, max_shared)
    if why is None:
        plan.prefill_shared = prefill_shared_bytes(geometry.head_dim, geometry.dtype.itemsize, geometry.kv_fp8)
        plan.prefill_rows = prefill_rows(geometry.head_dim)
        prefill = model + (("PREFILL_BLOCK_M", prefill_rows(geometry.head_dim)), ("PREFILL_BLOCK_N", PREFILL_BLOCK_N),
                           ("PREFILL_WARPS", PREFILL_WARPS), ("PREFILL_M_TILES", prefill_m_tiles(geometry.head_dim)),
                           ("PREFILL_VEC_BYTES", row_vec_bytes(geometry.head_dim * geometry.dtype.itemsize)),
                           ("PREFILL_SHARED_BYTES", plan.prefill_shared)) + window
        if geometry.kv_fp8:  # the e4m3 rows' copies (Q's are PREFILL_VEC_BYTES)
            prefill += (("PREFILL_KV_VEC_BYTES", row_vec_bytes(geometry.head_dim)),)
        plan.files["paged_prefill.cu"] = (prefill, ("paged_prefill_attention",))
    else:
        plan.fallbacks["prefill attention"] = why

    plan.heads_per_cta = heads_per_cta(config.num_heads // config.num_kv_heads)
    small_q = plan.heads_per_cta <= 4  # q and its sums in registers leave room for more rows and CTAs
    plan.attn_min_ctas = MIN_CTAS_SMALL_Q if small_q else MIN_CTAS_LARGE_Q
    unroll = UNROLL_SMALL_Q if small_q else UNROLL_LARGE_Q
    shape = AttentionShape(geometry.head_dim, geometry.itemsize, plan.heads_per_cta, geometry.block_size, unroll,
                           geometry.kv_fp8)
    why = shape.unsupported()
    if held or why is not None:
        pool = " with an fp8 pool" if geometry.kv_fp8 else ""
        plan.fallbacks["decode attention"] = held or (
            f"head_dim {geometry.head_dim} in {str(geometry.dtype).removeprefix('torch.')}{pool}: {why}")
        return plan
    attention = model + (
        ("HEADS_PER_CTA", plan.heads_per_cta),
        ("PARTITION_SIZE", PARTITION_SIZE),
        ("ATTN_THREADS", ATTN_THREADS),
        ("ATTN_UNROLL", unroll),
        ("ATTN_STAGES", ATTN_STAGES),
        ("ATTN_MIN_SPAN", MIN_SPAN),
        ("ATTN_MIN_CTAS", plan.attn_min_ctas),
        ("ATTN_CLUSTER", ATTN_CLUSTER),
        ("ATTN_CLUSTER_MIN_SPAN", CLUSTER_MIN_SPAN),
        ("ATTN_VEC_BYTES", shape.vec_bytes),
        # the batch's lengths, slots and first blocks read before the programmatic-launch wait: with
        # fp8 weights that measured faster at batches 1 and 2, with bf16 weights slower
        ("ATTN_READ_BATCH_EARLY", int(fp8_weights)),
    ) + window
    names = ("paged_attention_decode",) + (("paged_attention_decode_cluster",) if clusters else ())
    plan.files["paged_attention.cu"] = (attention, names)
    if DECODE_MMA_KERNEL and decode_mma_unsupported(config, geometry, tensor_cores, max_shared) is None:
        plan.decode_mma_shared = decode_mma_shared_bytes(geometry.head_dim, geometry.dtype.itemsize, geometry.kv_fp8)
        decode_mma = model + (("DECODE_MMA_WARPS", DECODE_MMA_WARPS), ("DECODE_MMA_KEYS", DECODE_MMA_KEYS),
                              ("DECODE_MMA_STAGES", DECODE_MMA_STAGES),
                              ("DECODE_MMA_VEC_BYTES", row_vec_bytes(geometry.head_dim * geometry.itemsize)),
                              ("DECODE_MMA_SHARED_BYTES", plan.decode_mma_shared)) + window
        plan.files["paged_decode_mma.cu"] = (decode_mma, ("paged_attention_decode_mma",))
    return plan


