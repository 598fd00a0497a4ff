"""Backends: the steps of a forward pass, behind one small interface.

What model/network.py calls, layer by layer:
- `attention_inputs(layer, x, norm_weight, qkv, eps, batch, bias=None, normed=None, qk_norm=None)`:
  RMSNorm(x) @ qkv.T (+ bias), the heads' RMSNorms of q and k where `qk_norm` gives their weights
  (Qwen3), RoPE, and k and v into their cache blocks; returns the rotated queries;
- `attend(layer, q, batch)`: each new token's query against its sequence's K/V, read through the
  block table (causal: a token sees its own position and the ones before it);
- `linear_add_norm(x, weight, residual, norm_weight, eps, bias=None)`: residual + (x @ weight.T +
  bias) (the o and down projections), and RMSNorm of that sum by the norm it meets next, or None
  where the backend leaves the norm to the next step (gemv.cu fuses it into its GEMV); the network
  hands it on as that step's `normed`;
- `norm_linear_silu(x, norm_weight, gate_up, eps, bias=None, normed=None)`: silu(gate) * up of
  RMSNorm(x) @ gate_up.T (+ bias) (the MLP's first half);
- `logits_greedy(x, norm_weight, lm_head, eps, normed=None)`: the final norm and the LM head, as
  float32, and each row's greedy token (`argmax`; NOT_FINITE for a row holding a NaN or an inf, so
  the engine fails that request alone).

`normed`, where given, is RMSNorm(x) by norm_weight already (from linear_add_norm): the step may
use it instead of norming x (a kernel that norms x as it loads it, gemv.cu's, leaves it). `bias` is
None unless the model has it (ModelConfig's qkv_bias, o_bias, mlp_bias; fused like the weights:
q|k|v, gate|up).
RoPE's cos and sin come from `backend.rope` (pagedcli.model.rope.RotaryTable): fixed tables
`backend.cos`, `backend.sin` for the static types, per-token rows for dynamic NTK.

Around it: `prepare(batch)` (the network, once per forward pass: index tensors the layers share).
The halves the fused steps are made of are methods too, used by fallbacks and tests: `rms_norm`,
`norm_linear`, `linear_add`, `silu_mul`, `rope_write_kv`, `logits` and `argmax`; composed.py builds
the fused steps from any backend's halves.

`TorchBackend` is the reference (CPU and GPU); `CpuBackend` (cpu.py), what a CPU run uses, is the
reference with a decode step of few ops and oneDNN's GEMMs; `CudaBackend` runs our own CUDA kernels
and holds a `TorchBackend` for what they do not serve.
"""

from pagedcli.backends.torch import TorchBackend

__all__ = ["TorchBackend"]
