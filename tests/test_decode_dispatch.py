"""Which decode attention kernel the CUDA backend runs at each batch size (CudaBackend.decode_kernel).
It is decided on the host from the batch size and the cache alone (one CUDA graph per batch size),
so it is checked here without a GPU, on an H200's launch shapes (132 SMs, thread-block clusters)
at Llama-3.2-1B's heads (32 query heads, 8 kv heads, 4 query heads a decode CTA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedcli.backends.cuda import CudaBackend
from pagedcli.backends.cuda_launch import LaunchShapes
from pagedcli.engine.cache import KVCache
from pagedcli.model.config import ModelConfig
from pagedcli.core.geometry import CacheGeometry
from pagedcli.model.source import RANDOM_PRESETS

SPLIT_KV, CLUSTER, MMA = "paged_attention_decode", "paged_attention_decode_cluster", "paged_attention_decode_mma"


def kernels_at(batches, max_model_len=131072, clusters=True, mma_built=True, window=None) -> dict[int, str]:
    config = ModelConfig.from_file(RANDOM_PRESETS["llama-3.2-1b"])
    cache = KVCache(CacheGeometry.build(config, torch.bfloat16, 16, num_blocks=64), 4, max_model_len, device="cpu")
    shapes = LaunchShapes(cache, config.num_heads, heads_per_cta=4, vec=8, num_sms=132, cluster=8 if clusters else 1,
                          window=window)
    backend = SimpleNamespace(shapes=shapes, decode_mma_shared=36864 if mma_built else 0)
    return {b: CudaBackend.decode_kernel(backend, b) for b in batches}


def test_tensor_cores_from_the_batch_whose_ctas_fill_the_gpu():
    """Clusters of 8 splits up to batch 8, split-KV while a (sequence, head group) still gets 2 or
    more CTAs of the 4 an SM the splits may use (528 / (8 b)), tensor cores from batch 34 on."""
    assert kernels_at([1, 8, 9, 16, 33, 34, 64, 256]) == {
        1: CLUSTER, 8: CLUSTER, 9: SPLIT_KV, 16: SPLIT_KV, 33: SPLIT_KV, 34: MMA, 64: MMA, 256: MMA}


def test_split_kv_where_the_tensor_core_kernel_is_not_built():
    """float32, a GPU before sm_80, more query heads a kv head than a tile holds
    (cuda_build.decode_mma_unsupported)."""
    assert kernels_at([1, 16, 64, 256], mma_built=False) == {1: CLUSTER, 16: SPLIT_KV, 64: SPLIT_KV, 256: SPLIT_KV}


def test_contexts_of_one_chunk_take_one_split_at_any_batch_without_clusters():
    """max_model_len 512 (one PARTITION_SIZE chunk): one split at every batch size; with clusters,
    small batches still spread each context over a cluster's 8 CTAs."""
    assert kernels_at([1, 16], max_model_len=512, clusters=False) == {1: MMA, 16: MMA}
    assert kernels_at([1, 16], max_model_len=512) == {1: CLUSTER, 16: MMA}


def test_a_sliding_window_bounds_the_splits_as_a_short_cache_does():
    """A window of 497 (its keys: at most 497 + 15, one chunk) takes the dispatch of a 512-token
    cache whatever max_model_len is; Mistral's 4,096 that of a cache of 4,111 tokens."""
    assert kernels_at([1, 16], window=497, clusters=False) == {1: MMA, 16: MMA}
    assert kernels_at([1, 16, 34], window=497) == kernels_at([1, 16, 34], max_model_len=512)
    assert kernels_at([1, 9, 16, 34], window=4096) == kernels_at([1, 9, 16, 34], max_model_len=4096 + 15)
