"""Attention over the paged KV cache. A backend does two things per layer:

- `write_kv(layer, k, v, batch)`: put the new tokens' K/V into their blocks, through the block table;
- `attend(layer, q, batch)`: each new token's query against its sequence's K/V, read through the
  block table (causal: a token sees its own position and earlier ones).

`TorchAttention` is the reference (CPU and GPU); `CudaAttention` runs our own CUDA kernels.
"""

from pagedcli.attention.torch import TorchAttention

__all__ = ["TorchAttention"]
