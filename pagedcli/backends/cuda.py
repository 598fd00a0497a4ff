"""The CUDA backend: our own kernels (kernels/*.cu), compiled at run time by CuPy.

What runs where:
- `attention_inputs`, `norm_linear_silu`, `linear_add_norm`, `logits_greedy` (and `norm_linear`)
                   -> gemv.cu for up to GEMV_MAX_ROWS rows (decode at small batches): one kernel per
                      GEMM with its RMSNorm, RoPE and K/V write, SiLU-mul or residual add fused in;
                      more rows: cuBLAS beside elementwise.cu's `add_rms_norm` (the residual add
                      and the next norm in one kernel), `rms_norm` (the first layer's) and
                      `silu_mul`, and `rope_write_kv`;
- `rope_write_kv`  -> kv_write.cu: RoPE on q and k fused with the K/V write into the paged pool;
- `attend`         -> paged_attention.cu at decode (one split-KV kernel that also merges; at small
                      batches on sm_90+ its splits run in thread-block clusters and merge in shared
                      memory); where one CTA per (sequence, kv head) fills the GPU (no split),
                      paged_decode_mma.cu, the GQA group's heads as the rows of mma tiles;
                      paged_prefill.cu for a step's prompts (tensor-core tiles, every
                      sequence's rows in one launch, K/V read through the block table; where
                      the tiles are too few to fill the GPU, their keys split into parts);
                      on sm_90+ a whole prompt of cudnn_prefill.CUDNN_MIN_TOKENS (3,072) or more
                      through cuDNN's fused attention instead (cudnn_prefill.py: wgmma, twice
                      paged_prefill.cu's rate); a sliding window (Mistral) is compiled into all
                      three of ours (SLIDING_WINDOW: they read only the window's keys), and
                      keeps its prompts off cuDNN's path, which has no window;
- `argmax`         -> argmax.cu: greedy tokens, the vocabulary split over many CTAs; with
                      `logits_greedy` past gemv.cu's rows, the same pass widens the LM head's
                      product to the float32 logits.

FP8 (model/fp8.py): Fp8Weights go through gemv.cu's gemv8_ kernels at up to W8A16_MAX_ROWS rows and
through fp8_quant.cu and torch._scaled_mm beyond (cuda_fp8_gemm.py: W8A8 on fp8 tensor cores), or
where a GPU has none, composed.linear's torch ops (`fallbacks` says so, and the loader tells the user). An fp8
pool is written and read by the same kernels, compiled for it (cuda_build.KV_DTYPE_DEFINES): the
K/V write (kv_write.cu and gemv.cu's qkv epilogue) quantizes, both attentions dequantize, with the
layer's scales (`store.kv_scales`) as their last arguments.

Compressed weights (model/quant.py's QuantWeight: GGUF, AWQ/GPTQ, `quantization` int4/int8): gemv.cu's
gemvq4_/gemvq8_ kernels (built from gemv_quant.cu) at up to GEMV_MAX_ROWS rows, with the same
fusions; more rows through cuda_quant.py (torch's int4 GEMM, or a copy dequantized once and cuBLAS).

Kernels are compiled once per geometry (the `-D` defines from `CacheGeometry.defines()`, plus the
head count and the dtype) and cached in-process; CuPy also caches the binaries on disk. Every
launch goes on torch's current stream, with raw device pointers of torch tensors (no copies).

The decode path is safe to capture in a CUDA graph: no host-device sync, no decision taken on
tensor contents, grids that depend only on the batch size and `store.max_model_len`, and scratch
buffers allocated once per batch size. Compilation happens in `__init__`, never during capture.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedcli.backends import composed
from pagedcli.backends.cuda_build import (
    ARGMAX_CHUNK,
    ARGMAX_THREADS,
    ATTN_CLUSTER,
    ATTN_THREADS,
    CUDNN_PREFILL,
    DECODE_MMA_WARPS,
    DTYPE_DEFINES,
    GEMV_MAX_SHARED,
    KV_WRITE_THREADS,
    PREFILL_SPLIT,
    PREFILL_WARPS,
    PROGRAMMATIC_LAUNCH,
    ROPE_VEC_MIN_CTAS_PER_SM,
    SILU_THREADS,
    VEC_BYTES,
    fp8_fallback_note,
    gemv_kernel_names,
    plan_kernels,
    quant_kernel_names,
    unverified_kernels,
)
from pagedcli.backends.cuda_compile import compile_kernels, cuda_available
from pagedcli.backends.cuda_fp8_gemm import fp8_gemm, scaled_mm_missing
from pagedcli.backends.cuda_gemv import gemv
from pagedcli.backends.cuda_launch import (
    Launcher,
    LaunchShapes,
    PrefillWork,
    aligned,
    leading_single_rows,
    prefill_work,
    ptr,
    resident_ctas,
    row_threads,
)
from pagedcli.backends.cuda_quant import int4mm_probe, int4mm_unsupported, is_quant, quant_gemm
from pagedcli.backends.cudnn_prefill import attend_whole_prompt, cudnn_prefill_missing, warm_up, whole_prompt_rows
from pagedcli.backends.torch import TorchBackend
from pagedcli.backends.torch_decode import decode_attention_full_width
from pagedcli.core.batch import StepBatch
from pagedcli.core.errors import RunError
from pagedcli.core.kv_store import KVStore
from pagedcli.model.config import ModelConfig


class CudaBackend:
    def __init__(self, store: KVStore, config: ModelConfig, fp8_weights: bool = False,
                 quant: tuple[tuple[int, int, int, int], ...] = ()):
        ok, why = cuda_available()
        if not ok:
            raise RunError(f"the CUDA backend cannot run: {why}", "use the torch backend instead")
        if store.device.type != "cuda":
            raise RunError(f"the CUDA backend needs the KV cache on a CUDA device, not {store.device}")
        geo = store.geometry
        if geo.dtype not in DTYPE_DEFINES:
            raise RunError(f"the CUDA kernels do not support dtype {geo.dtype}", "use bfloat16, float16 or float32")
        self.store, self.config = store, config
        # the torch ops, called by name wherever a kernel of ours does not apply
        self.reference = TorchBackend(store, config)
        self.rope, self.cos, self.sin = self.reference.rope, self.reference.cos, self.reference.sin
        self.device_index = store.device.index if store.device.index is not None else torch.cuda.current_device()
        self.dtype = geo.dtype
        self.num_heads = config.num_heads
        self.head_dim = geo.head_dim
        self.vec = VEC_BYTES // geo.dtype.itemsize  # model-dtype elements in a 16-byte vector
        self.kv_fp8 = geo.kv_fp8  # the kernels read a layer's row of the scales as float32 [kv_heads] (KVStore's)
        self.scale_log2 = np.float32(math.log2(math.e) / math.sqrt(geo.head_dim))
        self.max_context = store.max_blocks_per_seq * geo.block_size  # the block table's width in tokens
        self.num_sms = torch.cuda.get_device_properties(self.device_index).multi_processor_count
        capability = torch.cuda.get_device_capability(self.device_index)
        self.cluster = ATTN_CLUSTER if capability >= (9, 0) else 1  # thread-block clusters: sm_90 and newer

        # which kernels serve this geometry (cuda_build.py checks every compile-time limit first);
        # `fallbacks`: the ops that run as torch ops instead, and why (the loader tells the user)
        import cupy

        optin = cupy.cuda.Device(self.device_index).attributes["MaxSharedMemoryPerBlockOptin"]
        plan = plan_kernels(config, geo, clusters=self.cluster > 1, tensor_cores=capability >= (8, 0), max_shared=optin,
                            fp8_weights=fp8_weights, fp8_tensor_cores=capability >= (8, 9), quant=quant)
        self.fallbacks = dict(plan.fallbacks)
        # compressed weights (`quant`: their formats, cuda_quant.quant_formats): gemv_quant.cu's bits,
        # and past 2 rows torch's int4 GEMM in the nibble order it reads here (None: the dense copies)
        self.quant_bits = tuple(sorted({f[0] for f in quant})) if unverified_kernels() else ()
        self.int4mm_order = None
        if any(int4mm_unsupported(*f, geo.dtype, capability >= (8, 0)) is None for f in quant):
            self.int4mm_order, why = int4mm_probe(store.device)
            if why is not None:
                self.fallbacks["compressed linear layers over 2 rows"] = (
                    f"{why}: a copy dequantized to {str(geo.dtype).removeprefix('torch.')} once, then cuBLAS")
        self.fp8_gemm = plan.fp8_gemm  # cuda_fp8_gemm.py's W8A8 GEMMs serve fp8 weights over W8A16_MAX_ROWS rows
        missing = scaled_mm_missing(self.device_index, self.dtype) if self.fp8_gemm else None
        if missing is not None:
            self.fp8_gemm = False
            self.fallbacks["linear layers"] = fp8_fallback_note(missing)
        self.heads_per_cta = plan.heads_per_cta
        self.rope_vec = plan.rope_vec
        self.attention_kernel = plan.attention_decode
        self.prefill_kernel, self.prefill_shared, self.prefill_rows = (plan.attention_prefill, plan.prefill_shared,
                                                                       plan.prefill_rows)
        self.decode_mma_shared = plan.decode_mma_shared  # 0: paged_decode_mma.cu is not built
        self._prefill_work: PrefillWork | None = None  # this prefill step's attention work (cuda_launch)
        # whole long prompts through cuDNN's attention (cudnn_prefill.py), where it runs: why not, or None
        if not self.prefill_kernel:
            self.cudnn_prefill_missing = "the prefill attention runs as torch ops here"
        elif not CUDNN_PREFILL:
            self.cudnn_prefill_missing = "switched off (cuda_build.CUDNN_PREFILL)"
        else:
            self.cudnn_prefill_missing = cudnn_prefill_missing(store.device, geo.dtype, config.num_heads,
                                                               geo.num_kv_heads, geo.head_dim, geo.kv_fp8,
                                                               config.sliding_window)
        self.cudnn_prefill = self.cudnn_prefill_missing is None
        self._whole_prompts: list[tuple[int, int, int]] = []  # this step's (sequence, first row, rows) for cuDNN
        # a prefill step can be replayed from a CUDA graph (cuda_prefill_graphs.py) when nothing in
        # it is decided from the step's host lists: our prefill kernel with the tiles the caller
        # staged, RoPE from fixed tables (and the K/V write with them); not with fp8 weights, whose
        # product depends on the step's rows (W8A16_MAX_ROWS), which the graphs pad
        self.captures_prefill = self.prefill_kernel and self.rope.static and not fp8_weights
        self.shapes = LaunchShapes(store, self.num_heads, self.heads_per_cta, self.vec, self.num_sms, self.cluster,
                                   config.sliding_window)
        d = self.device_index
        self.kernels = {}
        for file, (defines, names) in plan.files.items():
            self.kernels.update(compile_kernels(file, defines, names, d))
        for name in [*gemv_kernel_names(), *quant_kernel_names(self.quant_bits)]:  # staged inputs may pass
            self.kernels[name].max_dynamic_shared_size_bytes = GEMV_MAX_SHARED  # CUDA's default 48 KiB
        # a step's prefill tiles too few to fill the GPU have their keys split until the work list has
        # this many entries (cuda_launch.key_parts); 0: never
        self.prefill_split_tiles = 0
        if self.prefill_kernel:
            kernel = self.kernels["paged_prefill_attention"]
            kernel.max_dynamic_shared_size_bytes = self.prefill_shared
            if PREFILL_SPLIT:  # one wave: the CTAs the GPU holds at once, as tiles of every head
                per_sm = resident_ctas(kernel, PREFILL_WARPS * 32, d, 1, self.prefill_shared)
                self.prefill_split_tiles = per_sm * self.num_sms // self.num_heads
            self._prefill_scratch = self._split_prefill_scratch(self.prefill_split_tiles)
        if self.decode_mma_shared:
            self.kernels["paged_attention_decode_mma"].max_dynamic_shared_size_bytes = self.decode_mma_shared
        self.decode_ctas_per_sm = {}  # decode kernel -> CTAs an SM holds (for reports)
        if self.attention_kernel:
            split_kv = resident_ctas(self.kernels["paged_attention_decode"], ATTN_THREADS, d, plan.attn_min_ctas)
            self.decode_ctas_per_sm = {"paged_attention_decode": split_kv, "paged_attention_decode_cluster": split_kv}
        if self.decode_mma_shared:
            self.decode_ctas_per_sm["paged_attention_decode_mma"] = resident_ctas(
                self.kernels["paged_attention_decode_mma"], DECODE_MMA_WARPS * 32, d, 1, self.decode_mma_shared)
        self.launch = Launcher(self.kernels, d, programmatic=PROGRAMMATIC_LAUNCH and capability >= (9, 0))

    def _split_prefill_scratch(self, slots: int) -> tuple[torch.Tensor, ...]:
        """paged_prefill.cu's partial rows, maxima and sums of split tiles (a slot per entry of the
        work list that may be split), and a merge counter per slot and head, zero between launches."""
        f32 = dict(dtype=torch.float32, device=self.store.device)
        rows = max(1, slots) * self.num_heads * self.prefill_rows
        return (torch.empty(rows * self.head_dim, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32),
                torch.zeros(max(1, slots) * self.num_heads, dtype=torch.int32, device=self.store.device))

    def _layer_table(self, layer: int) -> tuple[np.uint64, np.int64, np.int32]:
        """This layer's block table as the kernels index it: table[slot * slot_stride + block]."""
        t = self.store.device_table  # [slots, layers, blocks] int32, contiguous
        base = t.data_ptr() + layer * t.stride(1) * t.element_size()
        return np.uint64(base), np.int64(t.stride(0)), np.int32(t.shape[2])

    # --- the backend interface ----------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        # the reference's index tensors for what it serves (prefill attention without our kernel,
        # per-token RoPE rows for dynamic NTK); decode needs nothing from the host: the batch
        # tensors go to the kernels
        torch_prefill = batch.is_prefill and not self.prefill_kernel
        self.reference.prepare_indices(batch, attention=torch_prefill, rope=not self.rope.static)
        if batch.is_prefill and self.prefill_kernel:
            self._whole_prompts = []
            if batch.prefill_work is not None:  # staged by a prefill graph (cuda_prefill_graphs.py)
                self._prefill_work = batch.prefill_work
            else:
                d = leading_single_rows(batch.num_new) if self.attention_kernel else 0
                whole = whole_prompt_rows(batch.num_new, batch.context_lens_host, d) if self.cudnn_prefill else []
                starts = np.cumsum([0] + batch.num_new[:-1]).tolist()
                self._whole_prompts = [(b, starts[b], batch.num_new[b]) for b in whole]
                self._prefill_work = prefill_work(batch.num_new, batch.context_lens_host, self.prefill_rows,
                                                  self.store.device, batch.slots[:d], batch.context_lens[:d], skip=d,
                                                  elsewhere=whole, split_tiles=self.prefill_split_tiles,
                                                  window=self.config.sliding_window)
            if self._prefill_work.decode_slots.shape[0]:
                self.shapes.scratch_for(self._prefill_work.decode_slots.shape[0])
        elif not batch.is_prefill:
            self.shapes.scratch_for(batch.slots.shape[0])

    def rope_write_kv(self, layer: int, q, k, v, batch: StepBatch):
        if not self.rope.static:  # the kernel reads fixed cos/sin tables
            return self.reference.rope_write_kv(layer, q, k, v, batch)
        T = q.shape[0]
        kv_heads = self.store.geometry.num_kv_heads
        if q.shape[1:] != (self.num_heads, self.head_dim) or k.shape[1:] != (kv_heads, self.head_dim) \
                or v.shape != k.shape or k.shape[0] != T:
            raise ValueError(f"rope_write_kv: unexpected shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        q, k, v = (self._heads_rows(x) for x in (q, k, v))
        q_out = torch.empty((T, self.num_heads, self.head_dim), dtype=self.dtype, device=q.device)
        if T == 0:
            return q_out
        # a work item: `vec` rotary pairs of a q or k head, or `vec` elements of V
        geo = self.store.geometry
        elements = (self.num_heads + geo.num_kv_heads) * self.head_dim // 2 + geo.kv_dim
        vec = self.rope_vec  # (the plan's: kv_write.cu's ROPE_VEC)
        if not (vec > 1 and T * -(-elements // (vec * KV_WRITE_THREADS)) >= ROPE_VEC_MIN_CTAS_PER_SM * self.num_sms
                and aligned(q, k, v, q_out, self.store.pool, self.cos, self.sin)
                and all(x.stride(0) % vec == 0 for x in (q, k, v))):
            vec = 1
        items = elements // vec
        self.launch(f"rope_write_kv_{'vec' if vec > 1 else 'scalar'}", (T, -(-items // KV_WRITE_THREADS)),
                    (KV_WRITE_THREADS,), (
            ptr(q), ptr(k), ptr(v), np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(v.stride(0)),
        ) + self.rope_kv_args(layer, batch, q_out))
        return q_out

    def attention_inputs(self, layer: int, x, norm_weight, qkv, eps, batch: StepBatch, bias=None, normed=None,
                         qk_norm=None):
        # gemv.cu adds no bias, norms no heads, and its epilogue reads fixed cos/sin tables
        if bias is None and qk_norm is None and self.rope.static:
            geo = self.store.geometry
            T = x.shape[0] if x.dim() == 2 else 0
            if T == batch.positions.shape[0] and qkv.shape[0] == (self.num_heads + 2 * geo.num_kv_heads) * self.head_dim:
                q = gemv(self, "rms_norm_rope_kv", x, qkv, norm_weight, eps, rope_kv=(layer, batch))
                if q is not None:
                    return q
        return composed.rope_write_qkv(self, layer, self.norm_linear(x, norm_weight, qkv, eps, bias, normed), batch,
                                       qk_norm, eps)

    def rope_kv_args(self, layer: int, batch: StepBatch, q_out: torch.Tensor) -> tuple:
        """kv_write.cu's arguments after q, k and v (gemv.cu's qkv epilogue takes the same)."""
        table, slot_stride, max_blocks = self._layer_table(layer)
        return (  # the batch's index tensors have the kernels' types (StepBatch's declared dtypes)
            ptr(q_out), ptr(self.store.pool), table, slot_stride, max_blocks,
            ptr(batch.positions), ptr(batch.token_seq), ptr(batch.slots),
            ptr(self.cos), ptr(self.sin), np.int32(self.cos.shape[0]),
        ) + self._kv_scale_args(layer)

    def _kv_scale_args(self, layer: int) -> tuple:
        """The last arguments of every kernel that touches an fp8 pool: this layer's K and V scales,
        [kv_heads] float32 each (geometry.cuh's KV_SCALE_PARAMS); none for a pool in the model dtype."""
        if not self.kv_fp8:
            return ()
        scales = self.store.kv_scales
        return ptr(scales.k[layer]), ptr(scales.v[layer])

    def attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if batch.is_prefill:
            if not self.prefill_kernel:
                return self.reference.attend(layer, q, batch)
            return self._prefill_attend(layer, q, batch)
        B = batch.slots.shape[0]
        if q.shape[0] != B:
            raise ValueError(f"decode attend: {q.shape[0]} queries for {B} sequences")
        if not self.attention_kernel:
            scales = self.store.kv_scales
            k_scale, v_scale = (scales.k[layer], scales.v[layer]) if scales is not None else (None, None)
            return decode_attention_full_width(q, self.store.pool, self.store.device_table[:, layer], batch.slots,
                                               batch.context_lens, self.max_context, k_scale, v_scale,
                                               self.config.sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        self._decode_attend(layer, q, out, batch.slots, batch.context_lens)
        return out

    def decode_kernel(self, batch_size: int) -> str:
        """The decode attention kernel a batch of this size runs (where `attention_kernel`; else torch
        ops serve every batch). It depends on nothing else, so one CUDA graph per batch size holds
        it: paged_decode_mma.cu, where built (bf16/fp16 models), when the split-KV kernel would take
        one split (the batch alone fills the GPU with a CTA per sequence and head group, or without
        clusters every context fits one chunk); else paged_attention.cu, in clusters at small
        batches on sm_90+."""
        if self.shapes.num_splits(batch_size) == 1 and self.decode_mma_shared:
            return "paged_attention_decode_mma"
        return "paged_attention_decode_cluster" if self.shapes.uses_clusters(batch_size) else "paged_attention_decode"

    def _decode_attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                       context_lens: torch.Tensor) -> None:
        """Decode attention for the first B rows of q, into those of out: row b is the newest token
        of the sequence in slots[b], which sees its context_lens[b] keys (0: a padding row, zeros),
        through decode_kernel(B)."""
        B = slots.shape[0]
        if B == 0:
            return
        splits, part_out, part_max, part_sum, counters = self.shapes.scratch_for(B)
        table, slot_stride, _ = self._layer_table(layer)
        kernel = self.decode_kernel(B)
        if kernel == "paged_attention_decode_mma":  # one CTA per (sequence, kv head)
            self.launch(kernel, (self.store.geometry.num_kv_heads, B), (DECODE_MMA_WARPS * 32,), (
                ptr(out), ptr(q), ptr(self.store.pool), table, slot_stride, ptr(slots), ptr(context_lens),
                np.int32(self.max_context), self.scale_log2,
            ) + self._kv_scale_args(layer), shared_mem=self.decode_mma_shared)
            return
        self.launch(kernel, (self.num_heads // self.heads_per_cta, B, splits), (ATTN_THREADS,), (
            ptr(out), ptr(q), ptr(self.store.pool), table, slot_stride, ptr(slots), ptr(context_lens),
            np.int32(self.max_context), ptr(part_out), ptr(part_max), ptr(part_sum), ptr(counters),
            self.scale_log2,
        ) + self._kv_scale_args(layer))

    def _prefill_attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The step's first sequences that feed one token (their slots and contexts: the work list's
        last two) through the decode kernel, then the prefill kernel's tiles for the rest but the
        whole long prompts, which take cuDNN's attention last. In this order: a prefill graph runs
        the decode kernel over a fixed number of rows, and those past the step's one-token sequences
        are padding that writes zeros over rows the tiles then write."""
        work = self._prefill_work
        q = q.contiguous()
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        self._decode_attend(layer, q, out, work.decode_slots, work.decode_context)
        if work.tile_seq.shape[0]:
            table, slot_stride, _ = self._layer_table(layer)
            part_out, part_max, part_sum, counters = self._prefill_scratch
            grid = (work.tile_seq.shape[0] * self.num_heads,)
            self.launch("paged_prefill_attention", grid, (PREFILL_WARPS * 32,), (
                ptr(out), ptr(q), ptr(self.store.pool), table, slot_stride, ptr(work.tile_seq), ptr(work.tile_row),
                ptr(work.tile_part), ptr(work.tile_parts), ptr(work.seq_start), ptr(work.num_new),
                ptr(batch.context_lens), ptr(batch.slots), ptr(part_out), ptr(part_max), ptr(part_sum), ptr(counters),
                self.scale_log2,
            ) + self._kv_scale_args(layer), shared_mem=self.prefill_shared)
        for b, first, n in self._whole_prompts:
            out[first:first + n] = attend_whole_prompt(self.store, layer, q[first:first + n], batch.slots[b:b + 1])
        return out

    def prefill_graphs(self, model, max_tokens: int):
        """CUDA graphs for prefill-kind steps of up to `max_tokens` new tokens (cuda_prefill_graphs.py),
        or None where this model's prefill step cannot be captured (no prefill kernel, dynamic RoPE,
        fp8 weights' per-step quantization)."""
        if not self.captures_prefill:
            return None
        from pagedcli.backends.cuda_prefill_graphs import PrefillGraphs

        return PrefillGraphs(model, self.store, max_tokens)

    def plan_whole_prompts(self, max_tokens: int) -> int:
        """cuDNN's plans for every shape whole prompts of up to `max_tokens` tokens take (none where
        they do not take cuDNN): how many."""
        if not self.cudnn_prefill:
            return 0
        geo = self.store.geometry
        return warm_up(self.store.device, self.dtype, self.num_heads, geo.num_kv_heads, self.head_dim, max_tokens)

    def rms_norm(self, x, weight, eps):
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        if not self.fusable(x, weight) or rows == 0 or hidden != weight.numel():
            return self.reference.rms_norm(x, weight, eps)
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        vec = self._width(hidden, x, weight, out)
        threads = row_threads(hidden, vec)
        self.launch(f"rms_norm_{'vec' if vec > 1 else 'scalar'}", (rows,), (threads,), (
            ptr(x), ptr(weight), ptr(out), np.int32(hidden), np.float32(eps),
        ))
        return out

    def add_norm(self, residual, product, norm_weight, eps):
        """(residual + product, RMSNorm of the sum by norm_weight) in one kernel (elementwise.cu's
        add_rms_norm), the sum written into `residual`; composed.add_norm's torch ops for tensors
        it does not take, and without a norm_weight. (Its width decides the order of the sum of
        squares, as rms_norm's does: both take _width's; the product is a fresh GEMM output,
        aligned whenever the residual is.)"""
        if not (norm_weight is not None and self.fusable(residual, product, norm_weight) and residual.dim() == 2
                and product.shape == residual.shape and residual.shape[0] > 0
                and residual.shape[1] == norm_weight.numel() and residual.is_contiguous() and product.is_contiguous()
                and norm_weight.is_contiguous()):
            return composed.add_norm(self, residual, product, norm_weight, eps)
        rows, hidden = residual.shape
        out = torch.empty_like(residual)
        vec = self._width(hidden, residual, product, norm_weight, out)
        self.launch(f"add_rms_norm_{'vec' if vec > 1 else 'scalar'}", (rows,), (row_threads(hidden, vec),), (
            ptr(residual), ptr(product), ptr(norm_weight), ptr(out), np.int32(hidden), np.float32(eps),
        ))
        return residual, out

    def silu_mul(self, gate_up):
        if not self.fusable(gate_up) or gate_up.shape[-1] % 2:
            return self.reference.silu_mul(gate_up)
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
        total = out.numel()
        if total == 0:
            return out
        vec = self._width(inter, gate_up, out)
        blocks = max(1, min(-(-total // (vec * SILU_THREADS)), 16 * self.num_sms))
        self.launch(f"silu_mul_{'vec' if vec > 1 else 'scalar'}", (blocks,), (SILU_THREADS,), (
            ptr(gate_up), ptr(out), np.int32(inter), np.int64(total),
        ))
        return out

    def argmax(self, logits):
        if not (logits.dtype == torch.float32 and self._argmax_serves(logits)):
            return self.reference.argmax(logits)
        B, vocab = logits.shape
        tokens, scratch = self._argmax_outputs(B, logits.device)
        self.launch("argmax_rows", (self._argmax_chunks(vocab), B), (ARGMAX_THREADS,), (
            ptr(logits), np.int64(logits.stride(0)), np.int32(vocab), ptr(tokens),
        ) + scratch)
        return tokens

    def _widen_argmax(self, product):
        """(product as float32, its greedy tokens) in one kernel: a product in the model dtype that
        argmax.cu serves (logits_greedy checks)."""
        B, vocab = product.shape
        logits = torch.empty((B, vocab), dtype=torch.float32, device=product.device)
        vectors = vocab % self.vec == 0 and product.stride(0) % self.vec == 0 and aligned(product, logits)
        tokens, scratch = self._argmax_outputs(B, product.device)
        self.launch("argmax_rows_widen", (self._argmax_chunks(vocab), B), (ARGMAX_THREADS,), (
            ptr(product), np.int64(product.stride(0)), ptr(logits), np.int64(logits.stride(0)), np.int32(vocab),
            np.int32(vectors), ptr(tokens),
        ) + scratch)
        return logits, tokens

    def _argmax_serves(self, x) -> bool:
        """Rows argmax.cu takes: on our GPU, each row contiguous, at least one."""
        return x.is_cuda and x.device.index == self.device_index and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0

    def _argmax_chunks(self, vocab: int) -> int:
        """argmax.cu's CTAs a row: ARGMAX_CHUNK logits each, at most 4 an SM across the row."""
        return max(1, min(-(-vocab // ARGMAX_CHUNK), 4 * self.num_sms))

    def _argmax_outputs(self, rows: int, device) -> tuple:
        """The tokens argmax.cu writes, and its keys and counters (allocated once per batch size)."""
        keys, counters = self.shapes.argmax_scratch_for(rows, device)
        return torch.empty(rows, dtype=torch.int64, device=device), (ptr(keys), ptr(counters))

    # --- GEMMs with what surrounds them: gemv.cu at small batches ---------------------------------
    def norm_linear(self, x, norm_weight, weight, eps, bias=None, normed=None):
        out = gemv(self, "rms_norm_store", x, weight, norm_weight, eps) if bias is None else None
        return out if out is not None else self._normed_product(x, norm_weight, weight, eps, bias, normed)

    def logits(self, x, norm_weight, lm_head, eps, normed=None):
        return self._lm_head(x, norm_weight, lm_head, eps, normed).float()

    def logits_greedy(self, x, norm_weight, lm_head, eps, normed=None):
        """The float32 logits and their greedy tokens. A product in the model dtype (past gemv.cu's
        rows) is widened by argmax.cu as it finds each row's maximum: one pass, not a conversion
        kernel and then the argmax."""
        out = self._lm_head(x, norm_weight, lm_head, eps, normed)
        if out.dtype == self.dtype != torch.float32 and self._argmax_serves(out):
            return self._widen_argmax(out)
        logits = out.float()
        return logits, self.argmax(logits)

    def _lm_head(self, x, norm_weight, lm_head, eps, normed=None):
        """The final norm and the LM head: float32 logits from gemv.cu at its rows, else the
        product in the model dtype."""
        out = gemv(self, "rms_norm_float", x, lm_head, norm_weight, eps)
        return out if out is not None else self._normed_product(x, norm_weight, lm_head, eps, normed=normed)

    def norm_linear_silu(self, x, norm_weight, gate_up, eps, bias=None, normed=None):
        out = gemv(self, "rms_norm_silu_mul", x, gate_up, norm_weight, eps) if bias is None else None  # (no bias)
        if out is None:
            out = self.silu_mul(self._normed_product(x, norm_weight, gate_up, eps, bias, normed))
        return out

    def _normed_product(self, x, norm_weight, weight, eps, bias=None, normed=None):
        """RMSNorm(x) @ weight.T (+ bias) where gemv.cu does not serve (past its rows, a bias, shapes
        it does not take): W8A8 for an fp8 weight (whose quantization of the rows does the norm,
        unless `normed` holds it already: the same bytes), cuda_quant.py's GEMMs for a QuantWeight,
        else cuBLAS after our rms_norm (or on `normed`)."""
        if is_quant(weight):
            return quant_gemm(self, self.rms_norm(x, norm_weight, eps) if normed is None else normed, weight, bias)
        if normed is None:
            out = fp8_gemm(self, x, weight, norm_weight, eps, bias)
        else:
            out = fp8_gemm(self, normed, weight, bias=bias)
        return out if out is not None else composed.norm_matmul(self, x, norm_weight, weight, eps, bias, normed)

    def linear(self, x, weight, bias=None):
        """x @ weight.T (+ bias) alone (a partial product under tensor parallelism): as
        _normed_product computes it on rows normed already."""
        return self._normed_product(x, None, weight, 0.0, bias, normed=x)

    def linear_add(self, x, weight, residual, bias=None):
        return self.linear_add_norm(x, weight, residual, None, 0.0, bias)[0]

    def linear_add_norm(self, x, weight, residual, norm_weight, eps, bias=None):
        """residual + x @ weight.T (+ bias), and its RMSNorm by norm_weight: at gemv.cu's rows the
        add is in the GEMV's epilogue and the norm is left (None) to the next GEMV, which norms its
        rows as it stages them; past them, cuBLAS (W8A8 for an fp8 weight) and then add_norm, the
        add and the norm in one kernel. The residual may be updated in place."""
        out = gemv(self, "plain_add", x, weight, residual=residual) if bias is None else None  # (no bias)
        if out is not None:
            return out, None
        product = quant_gemm(self, x, weight, bias) if is_quant(weight) else fp8_gemm(self, x, weight, bias=bias)
        if product is None:
            product = composed.linear(x, weight, bias)
        return self.add_norm(residual, product, norm_weight, eps)

    # --- helpers --------------------------------------------------------------------------------
    def fusable(self, *tensors: torch.Tensor) -> bool:
        """Tensors our elementwise kernels take: the model dtype, on our GPU (else: torch fallback).
        (Compare device indices: torch.device("cuda") != torch.device("cuda", 0).)"""
        return all(t.dtype == self.dtype and t.is_cuda and t.device.index == self.device_index for t in tensors)

    def _width(self, n: int, *tensors: torch.Tensor) -> int:
        """Elements an elementwise kernel's thread takes at once along rows of `n`: a 16-byte vector
        where the rows are whole vectors and every tensor starts aligned, else 1 (its _scalar twin)."""
        return self.vec if n % self.vec == 0 and aligned(*tensors) else 1

    def _heads_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] with heads contiguous within a token (any token stride): the layout
        kv_write.cu reads. Column slices of the fused qkv output already are; others are copied."""
        if x.dtype != self.dtype:
            raise ValueError(f"expected {self.dtype}, got {x.dtype}")
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] != self.head_dim:
            x = x.contiguous()
        return x
