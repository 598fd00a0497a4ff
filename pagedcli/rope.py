"""Rotary position embeddings as Hugging Face Llama applies them: rotate-half pairs (i, i + d/2),
with Llama-3 frequency scaling when config.json asks for it, the same at prefill and at decode
(tiny-vllm's decode used interleaved pairs and no scaling: its fault, not copied)."""

from __future__ import annotations

import math

import torch

from pagedcli.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's long-context scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between (as transformers' `_compute_llama3_parameters`)."""
    factor, low, high = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos and sin for every position up to `max_positions`, computed once in float32."""

    def __init__(self, config: ModelConfig, max_positions: int, device):
        inv_freq = inverse_frequencies(config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] already in x's dtype."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]
