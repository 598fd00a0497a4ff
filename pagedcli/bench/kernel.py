"""Time our paged decode-attention kernel alone, next to torch SDPA over a contiguous copy of the
same K/V.

One layer's worth of cache per configuration (batch x context): the pool is filled with random
numbers, every sequence gets its blocks in shuffled order, and the paged kernel (one launch: the
splits and their merge) reads them through the block table. SDPA gets the same K/V gathered into
contiguous [batch, kv_heads, context, head_dim] tensors (`enable_gqa`), the layout a non-paged
engine keeps.

Each call is timed inside a CUDA graph (so Python launch overhead does not count), with CUDA events
around each replay; the figure is the median over replays. Several copies of the K/V (different
blocks of one pool, different contiguous tensors) are used in turn so that the 60 MB L2 cache does
not serve a small configuration from the previous call; the tiniest ones still partly fit in L2.

Effective bandwidth counts the bytes a decode step must move: K and V of every context token,
plus q read and the output written. With an fp8 pool (`cache_dtype`) the paged kernel reads e4m3
K/V (a byte an element, scales 1.0) and SDPA the same values in the model dtype, each counted at
its own bytes.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from pagedcli.core.batch import StepBatch
from pagedcli.core.fp8 import raw, to_fp8
from pagedcli.core.geometry import CacheGeometry
from pagedcli.engine.cache import KVCache
from pagedcli.model.config import ModelConfig

ROTATE_BYTES = 256 * 2**20  # aim for at least this much K/V across the copies used in turn
MAX_COPIES = 32
CALLS_PER_GRAPH = 8
REPLAYS = 25


def _config(num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": num_heads * head_dim,
        "intermediate_size": 4 * num_heads * head_dim,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_len,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }, source="kernel_bench")


def time_ms(calls: list) -> float:
    """Median milliseconds of one call. `calls` are closures over different data, used in turn."""
    for c in calls:  # warm up (and allocate whatever the calls allocate) outside the graph
        c()
    torch.cuda.synchronize()
    n = max(CALLS_PER_GRAPH, len(calls))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(n):
                calls[i % len(calls)]()
        replay = graph.replay
    except Exception:  # a call that cannot be captured: time it eagerly instead
        graph = None

        def replay():
            for i in range(n):
                calls[i % len(calls)]()

    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def bench_decode_kernel(batch_sizes, context_lens, head_dim: int = 64, num_heads: int = 32, num_kv_heads: int = 8,
                        block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                        max_model_len: int | None = None, cache_dtype: torch.dtype | None = None) -> list[dict]:
    """One row per (batch, context): batch, context, paged_ms, paged_gb_per_s, sdpa_ms, sdpa_gb_per_s,
    max_abs_diff (paged vs SDPA outputs), and the paged kernel's name (CudaBackend.decode_kernel:
    it depends on the batch and max_model_len), splits, registers per thread and resident CTAs per SM.

    `max_model_len` (default: the context) is the cache's limit, which sets the paged kernel's
    grid: a larger one shows what a short context costs in an engine sized for long ones.
    `cache_dtype`: the pool's element when it is not `dtype` (fp8)."""
    from pagedcli.backends.cuda import CudaBackend

    device = torch.device("cuda")
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool_itemsize = (cache_dtype or dtype).itemsize
    rows = []
    for context in context_lens:
        limit = max(context, max_model_len or context)
        config = _config(num_heads, num_kv_heads, head_dim, limit, dtype)
        for batch in batch_sizes:
            kv_elements = batch * context * num_kv_heads * head_dim * 2
            kv_bytes = kv_elements * pool_itemsize
            copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / kv_bytes)))
            blocks_per_seq = math.ceil(context / block_size)
            geo = CacheGeometry(block_size, num_kv_heads, head_dim, 1, copies * batch * blocks_per_seq, dtype,
                                cache_dtype)
            cache = KVCache(geo, max_slots=copies * batch, max_model_len=limit, device=device, shuffle_seed=0)
            if geo.kv_fp8:  # e4m3 of normal numbers (scales 1.0)
                raw(cache.store.pool).copy_(raw(to_fp8(torch.randn(cache.store.pool.shape, device=device))))
            else:
                cache.store.pool.normal_()
            for slot in range(copies * batch):
                cache.grow(slot, context)
            cache.sync_device_table()
            backend = CudaBackend(cache.store, config)
            kernel = backend.decode_kernel(batch) if backend.attention_kernel else None  # None: torch ops

            steps, sdpa_inputs = [], []
            for c in range(copies):
                slots = list(range(c * batch, (c + 1) * batch))
                step = StepBatch.build(False, slots, [[0]] * batch, [context - 1] * batch, device)
                q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
                steps.append((step, q))
                # the same K/V, gathered through the table into the contiguous layout SDPA reads
                physical = torch.as_tensor(cache.table[slots, 0, :blocks_per_seq], device=device).long()
                kv = raw(cache.store.pool)[physical]  # [B, blocks, 2, block_size, kv_heads, head_dim]
                kv = kv.view(cache.store.pool.dtype).to(dtype) if geo.kv_fp8 else kv  # (the scales are 1.0)
                kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, num_kv_heads, -1, head_dim)[..., :context, :]
                sdpa_inputs.append((q.unsqueeze(2), kv[0].contiguous(), kv[1].contiguous()))
                del kv
            backend.prepare(steps[0][0])  # allocates the split-KV scratch before capture

            paged_calls = [lambda s=s, q=q, b=backend: b.attend(0, q, s) for s, q in steps]
            sdpa_calls = [lambda i=i: F.scaled_dot_product_attention(*i, enable_gqa=True) for i in sdpa_inputs]
            step, q = steps[0]
            diff = (backend.attend(0, q, step).float() - sdpa_calls[0]().squeeze(2).float()).abs().max().item()
            paged_ms, sdpa_ms = time_ms(paged_calls), time_ms(sdpa_calls)

            q_out = 2 * batch * num_heads * head_dim * itemsize  # q in, out
            moved, sdpa_moved = kv_bytes + q_out, kv_elements * itemsize + q_out
            rows.append(dict(
                batch=batch, context=context, kv_dtype=str(geo.kv_dtype).removeprefix("torch."),
                paged_ms=paged_ms, paged_gb_per_s=moved / paged_ms / 1e6,
                sdpa_ms=sdpa_ms, sdpa_gb_per_s=sdpa_moved / sdpa_ms / 1e6,
                max_abs_diff=diff, splits=backend.shapes.num_splits(batch),
                kernel=kernel, registers=backend.kernels[kernel].num_regs if kernel else None,
                ctas_per_sm=backend.decode_ctas_per_sm.get(kernel),
            ))
            del backend, cache, steps, sdpa_inputs, paged_calls, sdpa_calls
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    for r in bench_decode_kernel([1, 8, 64], [512, 4096]):
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
