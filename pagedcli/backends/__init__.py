"""Backends: everything in a forward pass that is not a GEMM, behind one small interface.

- `prepare(batch)`: once per step, whatever index tensors the layers share;
- `norm_linear(x, norm_weight, weight, eps)`: RMSNorm(x) @ weight.T (qkv and gate/up, after their
  pre-norm); `logits(...)`: the same for the final norm and the LM head, as float32;
- `norm_linear_silu(x, norm_weight, gate_up, eps)`: silu(gate) * up of RMSNorm(x) @ gate_up.T (the
  MLP's first half);
- `linear_add(x, weight, residual)`: residual + x @ weight.T (the o and down projections);
- `argmax(logits)`: greedy tokens;
- `rope_write_kv(layer, q, k, v, batch)`: rotary embedding on q and k, then k and v into their cache
  blocks through the block table; returns the rotated q;
- `attend(layer, q, batch)`: each new token's query against its sequence's K/V, read through the
  block table (causal: a token sees its own position and the ones before it);

`TorchBackend` is the reference (CPU and GPU); `CudaBackend` runs our own CUDA kernels.
"""

from pagedcli.backends.torch import TorchBackend

__all__ = ["TorchBackend"]
