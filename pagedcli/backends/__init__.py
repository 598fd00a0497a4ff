"""Backends: the steps of a forward pass, behind one small interface (llama.py calls them in order).

- `prepare(batch)`: once per step, whatever index tensors the layers share;
- `attention_inputs(layer, x, norm_weight, qkv, eps, batch)`: RMSNorm(x) @ qkv.T, RoPE, and k and v
  into their cache blocks; returns the rotated queries;
- `norm_linear(x, norm_weight, weight, eps)`: RMSNorm(x) @ weight.T; `logits(...)`: the same for
  the final norm and the LM head, as float32;
- `norm_linear_silu(x, norm_weight, gate_up, eps)`: silu(gate) * up of RMSNorm(x) @ gate_up.T (the
  MLP's first half);
- `linear_add(x, weight, residual)`: residual + x @ weight.T (the o and down projections);
- `argmax(logits)`: greedy tokens;
- `rope_write_kv(layer, q, k, v, batch)`: rotary embedding on q and k, then k and v into their cache
  blocks through the block table; returns the rotated q (attention_inputs' second half);
- `attend(layer, q, batch)`: each new token's query against its sequence's K/V, read through the
  block table (causal: a token sees its own position and the ones before it);

`TorchBackend` is the reference (CPU and GPU); `CudaBackend` runs our own CUDA kernels.
"""

from pagedcli.backends.torch import TorchBackend

__all__ = ["TorchBackend"]
