"""FP8 (float8 e4m3, vLLM's `fp8`): the one definition of how pagedcli stores K/V and weights in 8 bits.

Both use torch.float8_e4m3fn (1 sign, 4 exponent, 3 mantissa bits; finite up to ±448, no inf) with
float32 scales:

- K/V (`kv_cache_dtype` fp8): stored = e4m3(x / scale), read = float(stored) * scale, one scale per
  layer and KV head (`KVScales`: k and v, [num_layers, num_kv_heads]); 1.0 unless the checkpoint
  ships k_scale / v_scale (vLLM's default and its names).
- weights (`quantization` fp8): the linear layers' [out, in] matrices as e4m3 values with a scale per
  output row (`Fp8Weight`), amax(|row|) / 448 when quantized at load.
- products with them (`fp8_linear`, vLLM's fp8 on Hopper: W8A8 with dynamic per-token activation
  scales): each activation row is quantized to e4m3 with its own scale amax(|row|) / 448, the e4m3
  activations times the e4m3 weights are summed in float32, times the row's scale times the weight
  row's scale, rounded to the model dtype. The torch path emulates it in float32 (exact: a product
  of two e4m3 values has 8 significant bits); a GPU with fp8 tensor cores runs torch._scaled_mm (or
  gemv.cu's mma kernels at decode), the same function up to the order of the float32 sums.

torch's float8 cast does not promise to saturate (out-of-range values may become NaN), so every
cast here clamps to ±FP8_MAX first. Gathers, scatters and copies of fp8 tensors go through their
uint8 view (`raw`): the same bytes, and ops every torch version has for every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype
# none; fp8: the linear layers; fp8-lm-head: the LM head too (the embeddings stay in the model dtype)
FP8_LM_HEAD = "fp8-lm-head"
QUANTIZATIONS = ("none", "fp8", FP8_LM_HEAD)
DEFAULT_KV_SCALE = 1.0  # vLLM's, when the checkpoint has none


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes as uint8 (a view: writes go through); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) as e4m3, saturated at ±448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# --- the KV cache --------------------------------------------------------------------------------
@dataclass
class KVScales:
    """The fp8 pool's scales: float32 [num_layers, num_kv_heads] each, on the pool's device."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def default(cls, num_layers: int, num_kv_heads: int, device) -> "KVScales":
        ones = torch.full((num_layers, num_kv_heads), DEFAULT_KV_SCALE, dtype=torch.float32, device=device)
        return cls(ones, ones.clone())

    def to(self, device) -> "KVScales":
        return KVScales(self.k.to(device), self.v.to(device))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [T, kv_heads, head_dim] in the compute dtype; scale: [kv_heads] (one layer's). The e4m3
    values the pool stores."""
    return to_fp8(x.float() / scale[:, None])


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored: [..., kv_heads, head_dim] e4m3 (or its uint8 bytes); scale: [kv_heads]. The values in `dtype`."""
    if stored.dtype == torch.uint8:
        stored = stored.view(FP8_DTYPE)
    return (stored.float() * scale[:, None]).to(dtype)


# --- weights -------------------------------------------------------------------------------------
@dataclass
class Fp8Weight:
    """A linear layer's weight in fp8: `values` [out, in] float8_e4m3fn, `scale` [out] float32;
    the weight is values * scale[:, None]."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale[:, None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [rows, K] as e4m3 with its own float32 scale: scale = amax(|row|) / 448,
    values = e4m3(row / scale), both in float32 (the kernels divide the same way). An all-zero row
    takes scale 1 (its values are zeros either way). Returns (values, scale [rows])."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    return to_fp8(x / scale[:, None]), scale


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per output channel (quantize_rows of the [out, in] matrix)."""
    return Fp8Weight(*quantize_rows(w))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, scaled_mm: bool = False) -> torch.Tensor:
    """x @ dequant(w).T in x's dtype, W8A8 (the module's docstring): x's rows quantized with their own
    scales, the float32 sum of the e4m3 products times the row's scale times the weight row's,
    rounded to x's dtype; a bias is added after, in x's dtype. The reference for the GPU kernels.
    scaled_mm: through torch._scaled_mm (fp8 tensor cores; the caller has probed it with
    fp8_gemm_refusal), where it takes the shape (scaled_mm_takes), else emulated in float32."""
    K = x.shape[-1]
    values, scale = quantize_rows(x.reshape(-1, K))
    if scaled_mm and values.shape[0] > 0 and scaled_mm_takes(w):
        y = torch._scaled_mm(values, w.values.T, scale_a=scale[:, None], scale_b=w.scale[None, :], out_dtype=x.dtype)
    else:
        y = ((values.float() @ w.values.float().T) * scale[:, None] * w.scale).to(x.dtype)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def scaled_mm_takes(w: Fp8Weight) -> bool:
    """Whether torch._scaled_mm takes this weight's shape (cuBLASLt's fp8 GEMM: both dimensions
    multiples of 16)."""
    N, K = w.shape
    return N % 16 == 0 and K % 16 == 0


def fp8_gemm_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch._scaled_mm cannot multiply e4m3 with per-row scales into `dtype` on `device`, or None
    when it can: one tiny call (a backend asks once, when it is made; never while a CUDA graph is
    captured). Only CUDA devices of compute capability 8.9 or newer have fp8 tensor cores; on the CPU
    the float32 emulation is the reference and the torch path."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no fp8 tensor cores (8.9 or newer)"
    try:
        w = Fp8Weight(torch.ones((16, 32), device=device).to(FP8_DTYPE), torch.full((16,), 0.5, device=device))
        y = fp8_linear(torch.ones((16, 32), dtype=dtype, device=device), w, scaled_mm=True)
        if not bool(((y.float() - 16.0).abs() < 0.1).all()):  # 32 products of 1 x 1, times 0.5
            return f"torch._scaled_mm returned {y.flatten()[0].item()} where 16 was due"
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        return f"torch._scaled_mm refused it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return None
