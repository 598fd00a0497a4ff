"""Compressed weights (model/quant.py's QuantWeight: W4A16, W8A16) on CUDA.

At 1 and 2 rows (decode at batches 1 and 2) gemv.cu's gemvq4_/gemvq8_ kernels read the values and
their groups as the QuantWeight holds them (cuda_gemv.py), with the same fusions as the dtype's
kernels: there the weights' bytes are the step's time, and a quarter of bf16's (4-bit, group 128)
is what the format is for. What they take: `gemv_unsupported`.

More rows (prefill, batches of 3 and more) need tensor cores, which read no 4-bit operand:
- 4-bit weights in bf16 models on sm_80+, groups of 32 to 256: torch's `_weight_int4pack_mm`
  (tinygemm: the weight dequantized to bf16 in registers, mma.sync), as gpt-fast runs int4. It
  takes its own tiled copy of the values (`_convert_weight_to_int4pack`, made once per weight
  and kept in the weight's `forms`: as many bytes again as the values) and bf16 scales and
  zeros, w = (q - 8) * scale + zero, so zero = offset + 8 * scale. The bf16 rounding of scale and
  zero moves each weight by up to 2^-9 of its group's scale: the product is the reference's within
  a bf16 weight's rounding, as a bf16 model's own GEMM is.
- everything else (8-bit, fp16 and float32 models, groups or widths tinygemm does not take, a
  torch without it): a copy dequantized to the model dtype, made once (in row chunks, so that no
  float32 copy of a whole matrix is ever made) and kept, then cuBLAS. That costs the dtype's bytes
  beside the compressed ones: the plan's notice says so (cuda_build.plan_kernels). Chosen over
  dequantizing into a scratch at every call (no memory kept) because that reads and writes the
  dtype's bytes every GEMM, slower than bf16 weights at decode batches, and over a GEMV of more
  rows, whose dequantization work grows with each row while the tensor cores' does not.
Which path is faster past 2 rows than the other is measured on a GPU (tools/gpu_round.sh QUANT=1);
until then tinygemm serves every row count it takes (gpt-fast's choice).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedcli.model.quant import QuantWeight

# gemv.cu: a 16-byte load of values (32 4-bit or 16 8-bit) lies within one group, whose length is a
# power of two (the kernel shifts, never divides), or the group is the whole row
GEMV_MIN_GROUP = {4: 32, 8: 16}
# _weight_int4pack_mm's groups; its K tiles (inner_k_tiles x 16 inputs, the widest dividing K)
INT4MM_GROUPS = (32, 64, 128, 256)
INT4MM_INNER_K_TILES = (8, 4, 2)
INT4MM_N_MULTIPLE = 8
DENSE_CHUNK_ROWS = 4096  # rows dequantized at once into the dense copy (a float32 chunk at a time)


def is_quant(weight) -> bool:
    return isinstance(weight, QuantWeight)


def gemv_unsupported(bits: int, group: int, K: int) -> str | None:
    """Why gemv.cu's compressed kernels cannot take a weight of `bits`, `group` and K inputs, or None
    (the staging limit and alignment are checked per call: cuda_gemv.gemv)."""
    whole_row = group == K
    if not whole_row and (group < GEMV_MIN_GROUP[bits] or group & (group - 1)):
        return (f"{bits}-bit weights in groups of {group}: gemv.cu takes groups of a power of two from "
                f"{GEMV_MIN_GROUP[bits]} inputs, or whole rows")
    if K % GEMV_MIN_GROUP[bits]:
        return f"rows of {K} inputs, not whole 16-byte loads of {bits}-bit values"
    return None


def group_shift(weight: QuantWeight) -> int:
    """gemv.cu's `shift`: log2 of the group, or for a row's one group a shift that takes every input
    of the row to group 0."""
    K = weight.shape[1]
    return 31 if weight.group == K and weight.group & (weight.group - 1) else weight.group.bit_length() - 1


def int4mm_unsupported(bits: int, group: int, N: int, K: int, dtype: torch.dtype, tensor_cores: bool) -> str | None:
    """Why _weight_int4pack_mm cannot take this weight and activations in `dtype`, or None."""
    if bits != 4:
        return "8-bit weights: torch has no int8 weight GEMM on CUDA"
    if dtype != torch.bfloat16:
        return f"torch's int4 GEMM takes bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    if not tensor_cores:
        return "torch's int4 GEMM needs sm_80 or newer"
    if group not in INT4MM_GROUPS:
        return f"groups of {group}: torch's int4 GEMM takes groups of {', '.join(map(str, INT4MM_GROUPS))}"
    if N % INT4MM_N_MULTIPLE or K % (INT4MM_INNER_K_TILES[-1] * 16):
        return f"a {N} x {K} weight: torch's int4 GEMM takes outputs in 8s and inputs in 32s"
    return None


def quant_formats(weights) -> tuple[tuple[int, int, int, int], ...]:
    """(bits, group, out, in) of every QuantWeight among a model's linear layers and LM head."""
    found = [weights.lm_head] + [w for layer in weights.layers for w in vars(layer).values()]
    return tuple(sorted({(w.bits, w.group, *w.shape) for w in found if isinstance(w, QuantWeight)}))


def plan_notes(formats: Iterable[tuple[int, int, int, int]], dtype: torch.dtype, tensor_cores: bool) -> dict[str, str]:
    """The plan's notices for compressed weights: what gemv.cu does not take (those run as the
    dense copy's cuBLAS at every row count), and what over 2 rows runs on a dequantized copy."""
    notes, dense, small = {}, set(), set()
    for bits, group, N, K in formats:
        why = gemv_unsupported(bits, group, K)
        if why is not None:
            small.add(why)
        why = int4mm_unsupported(bits, group, N, K, dtype, tensor_cores)
        if why is not None:
            dense.add(why)
    copy = f"a copy dequantized to {str(dtype).removeprefix('torch.')} once (its bytes beside the compressed ones)"
    if small:
        notes["compressed linear layers at 1 and 2 rows"] = f"{'; '.join(sorted(small))}: {copy}, then cuBLAS"
    if dense:
        notes["compressed linear layers over 2 rows"] = f"{'; '.join(sorted(dense))}: {copy}, then cuBLAS"
    return notes


# --- over 2 rows --------------------------------------------------------------------------------

def int4mm_probe(device: torch.device) -> tuple[bool | None, str | None]:
    """How _weight_int4pack_mm reads our packing on this GPU, found with one 8 x 64 product of known
    values: (True, None) where the even column goes in the high nibble (torch's own tests' and
    gpt-fast's order), (False, None) in the low one (ours), (None, why) where neither gives the
    product (or the op is missing)."""
    N, K, group = 8, 64, 32
    rows, cols = torch.meshgrid(torch.arange(N), torch.arange(K), indexing="ij")
    values = ((rows * 7 + cols * 3 + cols // 16) % 16).to(torch.uint8).to(device)
    want = (values.float() - 8).T  # scale 1, offset -8: zero 0
    x = torch.eye(K, dtype=torch.bfloat16, device=device)
    scales_and_zeros = torch.stack([torch.ones(K // group, N), torch.zeros(K // group, N)], dim=-1)
    scales_and_zeros = scales_and_zeros.to(torch.bfloat16).to(device)
    try:
        for high_first in (True, False):
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_for_int4mm(values, high_first), 2)
            out = torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)
            if torch.equal(out.float(), want):
                return high_first, None
    except Exception as e:  # whatever this torch raises for an op it lacks on this GPU
        return None, f"torch's int4 GEMM does not run here ({(str(e).splitlines() or [''])[0][:120]})"
    return None, "torch's int4 GEMM reads neither nibble order as the product of its values"


def pack_for_int4mm(values: torch.Tensor, high_first: bool) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K / 2], two a byte, the even column high or low."""
    v = values.to(torch.uint8)
    even, odd = v[:, 0::2], v[:, 1::2]
    return (even << 4 | odd) if high_first else (even | odd << 4)


def int4mm_form(weight: QuantWeight, high_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as _weight_int4pack_mm reads it: its tiled values and bf16 [groups, N, 2] scales and
    zeros (zero = offset + 8 * scale: w = (q - 8) * scale + zero)."""
    K = weight.shape[1]
    tiles = next(t for t in INT4MM_INNER_K_TILES if K % (t * 16) == 0)
    q = weight.q if not high_first else (weight.q << 4) | (weight.q >> 4)  # ours: the even column low
    packed = torch.ops.aten._convert_weight_to_int4pack(q.contiguous(), tiles)
    return packed, weight.scales_and_zeros(torch.bfloat16)


def dense_form(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight dequantized (q * scale + offset in float32, as the reference) to `dtype`, a chunk of
    rows at a time."""
    N, K = weight.shape
    out = torch.empty((N, K), dtype=dtype, device=weight.q.device)
    for a in range(0, N, DENSE_CHUNK_ROWS):
        b = min(N, a + DENSE_CHUNK_ROWS)
        part = QuantWeight(weight.q[a:b], weight.scale[a:b], None if weight.offset is None else weight.offset[a:b],
                           weight.bits, weight.group, weight.source)
        out[a:b] = part.dequantize(dtype)
    return out


def quant_gemm(be, x: torch.Tensor, weight: QuantWeight, bias=None) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias) in x's dtype past gemv.cu's rows (or where it does not take the
    weight): torch's int4 GEMM where it takes the weight (be.int4mm_order: its nibble order on this
    GPU, None: not here), else the dense copy through cuBLAS. Each weight's prepared form is made at
    its first product (a graph's capture runs the pass once first: never inside a capture) and kept
    in its `forms`."""
    N, K = weight.shape
    x = x.contiguous()
    order = be.int4mm_order
    if order is not None and int4mm_unsupported(weight.bits, weight.group, N, K, x.dtype, True) is None:
        packed, scales_and_zeros = weight.form(("cuda_int4mm", x.device.index, order),
                                               lambda w: int4mm_form(w, order))
        out = torch.ops.aten._weight_int4pack_mm(x, packed, weight.group, scales_and_zeros)
    else:
        dense = weight.form(("cuda_dense", x.device.index, x.dtype), lambda w: dense_form(w, x.dtype))
        out = x @ dense.T
    return out if bias is None else out.add_(bias)
