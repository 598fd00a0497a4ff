"""Rotary position embeddings as Hugging Face Llama applies them: rotate-half pairs (i, i + d/2),
the same at prefill and at decode (tiny-vllm's decode used interleaved pairs and no scaling: its
fault, not copied), with the frequency scalings of transformers' `modeling_rope_utils` computed as
it computes them (float32, the same operations in the same order):

- default, linear, llama3 and yarn give fixed frequencies: one cos/sin table indexed by position,
  which the CUDA kernels read (yarn also scales cos and sin by its attention factor);
- dynamic (NTK) recomputes the base from the sequence length S whenever S passes
  max_position_embeddings. transformers does it for its whole batch at once; with its KV cache at
  batch 1 a prompt is rotated with S = its length and each decoded token at position p with
  S = p + 1. Here every token uses its own sequence's S (the context length after this step), so a
  sequence's answer equals transformers' `generate` at batch 1 and does not depend on its batch mates.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedcli.model.config import ModelConfig

# The fields each supported type must have (transformers refuses the config without them too).
REQUIRED_FIELDS = {"default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                   "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
STATIC_TYPES = ("default", "linear", "yarn", "llama3")  # frequencies that do not depend on the sequence


def exponents(head_dim: int) -> torch.Tensor:
    """2i / d for the d/2 rotary pairs, float32 (the exponent of the base in every type)."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def inverse_frequencies(config: "ModelConfig") -> tuple[torch.Tensor, float]:
    """The static types' per-pair frequencies and the factor cos and sin are multiplied by (1 but for
    yarn); dynamic's frequencies at S <= max_position_embeddings (where it is the default)."""
    s, d = config.rope_scaling or {}, config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents(d))
    rope_type = config.rope_type
    if rope_type == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, s), 1.0
    if rope_type == "yarn":
        return _yarn(config, s)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's long-context scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between (as transformers' `_compute_llama3_parameters`)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(config: "ModelConfig", s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): interpolated low frequencies, extrapolated
    high ones, a linear ramp between, and cos/sin scaled by the attention factor."""
    d, base = config.head_dim, config.rope_theta
    old_len = s["original_max_position_embeddings"]
    factor = s["factor"] if s["factor"] is not None else config.max_position_embeddings / old_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryTable:
    """The model's cos and sin, in `dtype` on `device`.

    Static types: `cos` and `sin` are tables [max_positions, head_dim] indexed by position (what
    the CUDA kernels read). Dynamic: `cos` and `sin` are None; `rows` computes each token's own."""

    def __init__(self, config: "ModelConfig", max_positions: int, device, dtype=torch.float32):
        self.static = config.rope_type in STATIC_TYPES
        self.dtype, self.head_dim = dtype, config.head_dim
        self.cos = self.sin = None
        if self.static:
            inv_freq, scale = inverse_frequencies(config)
            cos, sin = _cos_sin(torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq, scale)
            self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        else:
            s = config.rope_scaling
            self.theta, self.factor = config.rope_theta, float(s["factor"])
            self.original_len = config.max_position_embeddings
            self.exponents = exponents(config.head_dim).to(device)

    def rows(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of tokens at `positions` in sequences of `seq_lens` tokens
        (each sequence's length after this step). Device ops only: safe in a CUDA graph."""
        if self.static:
            return self.cos[positions], self.sin[positions]
        # transformers' `_compute_dynamic_ntk_parameters` with S = max(seq_len, max_position_embeddings)
        d, f = self.head_dim, self.factor
        S = torch.clamp(seq_lens.long(), min=self.original_len)
        base = self.theta * ((f * S / self.original_len) - (f - 1)) ** (d / (d - 2))  # [T] float32
        inv_freq = 1.0 / (base[:, None] ** self.exponents[None, :])
        cos, sin = _cos_sin(positions[:, None].float() * inv_freq, 1.0)
        return cos.to(self.dtype), sin.to(self.dtype)


def _cos_sin(freqs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] already in x's dtype."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
