"""What an architecture family adds to Llama's decoder, as data: the registry (families/__init__.py)
reads config.json through the family its `architectures` names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedcli.core.errors import RunError

FROM_CONFIG = None  # a bias that is there when config.json's attention_bias says so (Llama's way)


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json's `architectures` entry (transformers' class name)
    model_type: str  # config.json's `model_type`, for a config without `architectures`
    qkv_bias: bool | None = FROM_CONFIG  # biases on the q, k and v projections
    o_bias: bool | None = FROM_CONFIG  # a bias on the o projection
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (self_attn.q_norm / k_norm)
    sliding_window: bool = False  # config.json's sliding_window (null: none) limits what a token attends to
    check: Callable[[dict, str], None] | None = None  # refuses settings the family has that pagedcli does not run

    def settings(self, d: dict, source: str) -> dict:
        """The ModelConfig fields this family sets from config.json `d` (beyond Llama's own)."""
        if self.check is not None:
            self.check(d, source)
        attention_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if self.sliding_window else None
        return dict(architecture=self.architecture,
                    qkv_bias=attention_bias if self.qkv_bias is FROM_CONFIG else self.qkv_bias,
                    o_bias=attention_bias if self.o_bias is FROM_CONFIG else self.o_bias,
                    qk_norm=self.qk_norm, sliding_window=window)


def refuse_sliding_window(d: dict, source: str) -> None:
    """Qwen2 and Qwen3 ship `use_sliding_window: false` (with a sliding_window that is then unused);
    a checkpoint that turns it on windows only its layers past max_window_layers, which pagedcli's
    one window for every layer does not run."""
    if d.get("use_sliding_window"):
        raise RunError(f"{source}: use_sliding_window true is not supported (released Qwen checkpoints have it false)",
                       "set use_sliding_window to false in config.json")
