"""QuantWeight products on the CPU (model/quant.py): torch's weight-only kernels where they serve
the format and are faster than the dequantized matrix, else the dequantized matrix, made once.

The choice, by measurement on SmolLM2-135M's shapes at batches 1 and 8 (docs/performance.md,
"Compressed weights on the CPU"):
- bfloat16 / float16 activations: 4-bit weights whose group torch's int4 kernel takes and whose
  outputs are a multiple of 16 through `_weight_int4pack_mm_for_cpu` (torch's own packing, and
  torch's convention w = (q - 8) * scale + zero, so zero = offset + 8 * scale); symmetric 8-bit
  weights with a scale per row (inputs a multiple of 16) through `_weight_int8pack_mm`; the rest
  (grouped 8-bit: GGUF's Q8_0, Q5_K, Q6_K) as the matrix dequantized to the activations' dtype
  (float16 follows bfloat16's choice, unmeasured).
- float32 activations: the float32 matrix (torch's weight-only kernels take a slow path for float32
  activations, far behind the float32 GEMM: docs/performance.md); the CPU backend multiplies by a
  oneDNN copy of it instead (backends/cpu.py), this module's copy serving the torch reference.
Each form is prepared the first time a weight meets an activation dtype and kept on the weight
(`QuantWeight.form`), never per step.
"""

from __future__ import annotations

import torch

from pagedcli.model.quant import QuantWeight

INT4PACK_GROUPS = (32, 64, 128, 256)  # the groups _weight_int4pack_mm_for_cpu takes
INT4PACK_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs outputs in sixteens
INT8PACK_IN_MULTIPLE = 16  # _weight_int8pack_mm reads inputs in sixteens: other widths crash it (torch 2.13)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def cpu_kind(w: QuantWeight, dtype: torch.dtype) -> str:
    """Which form serves `w` for activations of `dtype`: int4pack, int8pack or float."""
    if dtype in HALF_DTYPES:
        if w.bits == 4 and w.group in INT4PACK_GROUPS and w.shape[0] % INT4PACK_OUT_MULTIPLE == 0:
            return "int4pack"
        if w.bits == 8 and w.symmetric and w.group == w.shape[1] and w.shape[1] % INT8PACK_IN_MULTIPLE == 0:
            return "int8pack"
    return "float"


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.dequantize().T (+ bias) in x's dtype, x [..., in]."""
    rows = x.reshape(-1, x.shape[-1])
    kind = cpu_kind(w, x.dtype)
    if kind == "int4pack":
        packed, scales_zeros = w.form(("int4pack", x.dtype), lambda w: int4pack(w, x.dtype))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), packed, w.group, scales_zeros)
    elif kind == "int8pack":
        scale = w.form(("int8pack", x.dtype), lambda w: w.scale[:, 0].to(x.dtype).contiguous())
        y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), w.q, scale)
    else:
        y = rows @ w.form(("float", x.dtype), lambda w: w.dequantize(x.dtype)).T
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def int4pack(w: QuantWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed int4 values and its [in / group, out, 2] scales and zeros in `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.values().to(torch.int32), 1)
    return packed, w.scales_and_zeros(dtype)
