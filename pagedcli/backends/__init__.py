"""Backends: everything in a forward pass that is not a GEMM, behind one small interface.

- `prepare(batch)`: once per step, whatever index tensors the layers share;
- `add_rms_norm(x, residual, weight, eps)`: residual += x, then RMSNorm (the pre-norm of each block);
- `rope_write_kv(layer, q, k, v, batch)`: rotary embedding on q and k, then k and v into their cache
  blocks through the block table; returns the rotated q;
- `attend(layer, q, batch)`: each new token's query against its sequence's K/V, read through the
  block table (causal: a token sees its own position and the ones before it);
- `silu_mul(gate_up)`: SwiGLU's silu(gate) * up.

`TorchBackend` is the reference (CPU and GPU); `CudaBackend` runs our own CUDA kernels.
"""

from pagedcli.backends.torch import TorchBackend

__all__ = ["TorchBackend"]
