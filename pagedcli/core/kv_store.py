"""The KV cache's device side: the pool of blocks, the block table's device mirror and an fp8 pool's
scales. It is what the backends read and write; which block belongs to whom (the free list,
reference counts, the prefix cache and the host's table) is the engine's KVCache (engine/cache.py),
which tells this store of each change once per step."""

from __future__ import annotations

import numpy as np
import torch

from pagedcli.core.errors import allocation_failure
from pagedcli.core.fp8 import KVScales, raw
from pagedcli.core.geometry import CacheGeometry


class KVStore:
    """`pool`: [num_blocks][2][block_size][kv_heads][head_dim] (CacheGeometry.pool_shape), K then V;
    `device_table`: [max_slots][num_layers][max_blocks_per_seq] int32, -1 where unassigned;
    `kv_scales`: an fp8 pool's float32 K and V scales per layer and KV head (None otherwise)."""

    def __init__(self, geometry: CacheGeometry, table: np.ndarray, max_model_len: int,
                 device: torch.device | str = "cpu", kv_scales: KVScales | None = None):
        """`table`: the host's block table this store mirrors (on the CPU, the same memory)."""
        self.geometry = geometry
        self.max_slots, _, self.max_blocks_per_seq = table.shape
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        try:  # zeros, not empty: never-written token slots must hold finite numbers
            # (an fp8 pool is made as zero bytes and viewed as e4m3: +0.0 is all zero bits)
            self.pool = torch.zeros(geometry.pool_shape, dtype=torch.uint8 if geometry.kv_fp8 else geometry.kv_dtype,
                                    device=self.device).view(geometry.kv_dtype)
        except (RuntimeError, MemoryError) as e:
            oom = allocation_failure(e, f"the KV pool ({geometry.pool_bytes / 2**30:,.1f} GiB)",
                                     "use a smaller `cache_size` or `num_blocks`")
            if oom is None:
                raise
            raise oom from None
        self.kv_scales = None
        if geometry.kv_fp8:  # the checkpoint's, or 1.0; float32 and contiguous, as the kernels read them
            given = kv_scales or KVScales.default(geometry.num_layers, geometry.num_kv_heads, self.device)
            self.kv_scales = KVScales(given.k.to(self.device, torch.float32).contiguous(),
                                      given.v.to(self.device, torch.float32).contiguous())
        # on the CPU the device table is the host's table itself (shared memory): nothing to copy
        self.mirrors_host = self.device.type == "cpu"
        if self.mirrors_host:
            self.device_table = torch.from_numpy(table)
        else:
            self.device_table = torch.full(table.shape, -1, dtype=torch.int32, device=self.device)

    def write_table(self, index: np.ndarray, values: np.ndarray) -> None:
        """Set the flat entries `index` of the device table to `values`: one small host-to-device
        copy per step, instead of tiny-vllm's whole table for every layer. (On the CPU, where the
        device table is the host's, only another rank's changes come here: tensor parallelism.)"""
        if self.mirrors_host:
            self.device_table.view(-1)[torch.from_numpy(index)] = torch.from_numpy(values).to(torch.int32)
            return
        # from pinned memory, so that the copy waits in the stream behind the step in flight and the
        # host goes on: from pageable memory the host waits for the GPU's queue to drain
        # (batch.to_device says why), and the GPU then sits idle while the host queues the next step
        host = torch.empty((2, index.shape[0]), dtype=torch.int64, pin_memory=True)
        pair = host.numpy()
        pair[0], pair[1] = index, values
        packed = host.to(self.device, non_blocking=True)
        self.device_table.view(-1)[packed[0]] = packed[1].to(torch.int32)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks, K and V, as raw bytes whatever the pool's dtype (copy-on-write)."""
        src_t, dst_t = torch.from_numpy(src).long(), torch.from_numpy(dst).long()
        pool = raw(self.pool)  # non_blocking, as in write_table
        pool[dst_t.to(self.device, non_blocking=True)] = pool[src_t.to(self.device, non_blocking=True)]
