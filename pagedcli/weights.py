"""safetensors -> the tensors `Llama` computes with.

Tensors are read one at a time from memory-mapped files straight into their final dtype and
device, q/k/v and gate/up into fused matrices (one GEMM instead of three or two), so the model is
never held twice in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedcli.config import ModelConfig
from pagedcli.errors import RunError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_dim + 2 kv_dim, hidden]
    o: torch.Tensor  # [hidden, q_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    # biases, when config.json has attention_bias / mlp_bias (fused like their weights)
    qkv_bias: torch.Tensor | None = None  # [q_dim + 2 kv_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 intermediate]
    down_bias: torch.Tensor | None = None  # [hidden]


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

    @property
    def nbytes(self) -> int:
        """Bytes of distinct weight tensors (a tied lm_head counts once)."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [w for l in self.layers for w in vars(l).values()]:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_dim, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_dim, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_dim, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_dim),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (c.q_dim,), p + "self_attn.k_proj.bias": (c.kv_dim,),
                       p + "self_attn.v_proj.bias": (c.kv_dim,), p + "self_attn.o_proj.bias": (c.hidden_size,)}
        if c.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (c.intermediate_size,), p + "mlp.up_proj.bias": (c.intermediate_size,),
                       p + "mlp.down_proj.bias": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise RunError(f"{index} is not a valid safetensors index ({e})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise RunError(f"no model.safetensors in {folder}", "the folder needs model.safetensors or a sharded index")


class _TensorReader:
    """Looks tensors up across shards; checks each shape before reading it."""

    def __init__(self, files: list[Path], shapes: dict[str, tuple[int, ...]], dtype, device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.handles, self.where = [], {}
        for path in files:
            if not path.is_file():
                raise RunError(f"weights file {path} is missing", "download the checkpoint again")
            try:
                handle = safe_open(str(path), framework="pt")
                self.handles.append(handle)
                for name in handle.keys():
                    self.where[name] = handle
            except (SafetensorError, OSError, ValueError) as e:
                raise RunError(f"{path} is not a readable safetensors file ({e})", "download the checkpoint again") from None
        missing = [n for n in shapes if n not in self.where]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise RunError(f"tensor {missing[0]}{more} missing from {files[0].parent}", "is this a Llama checkpoint?")

    def read_into(self, name: str, out: torch.Tensor) -> None:
        handle = self.where[name]
        try:
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != self.shapes[name]:
                raise RunError(f"tensor {name} has shape {list(shape)}, config.json implies {list(self.shapes[name])}")
            out.copy_(handle.get_tensor(name))
        except (SafetensorError, OSError, ValueError) as e:
            raise RunError(f"tensor {name} could not be read ({e})", "the file may be truncated; download it again") from None

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
        self.read_into(name, out)
        return out

    def fused(self, names: list[str]) -> torch.Tensor:
        rows = [self.shapes[n][0] for n in names]
        out = torch.empty((sum(rows),) + self.shapes[names[0]][1:], dtype=self.dtype, device=self.device)
        for name, part in zip(names, out.split(rows)):
            self.read_into(name, part)
        return out


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype, device) -> Weights:
    shapes = expected_shapes(config)
    reader = _TensorReader(safetensors_files(Path(folder)), shapes, dtype, device)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = config.attention_bias, config.mlp_bias
        layers.append(LayerWeights(
            input_norm=reader.read(p + "input_layernorm.weight"),
            qkv=reader.fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            o=reader.read(p + "self_attn.o_proj.weight"),
            post_norm=reader.read(p + "post_attention_layernorm.weight"),
            gate_up=reader.fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=reader.read(p + "mlp.down_proj.weight"),
            qkv_bias=reader.fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"]) if attn else None,
            o_bias=reader.read(p + "self_attn.o_proj.bias") if attn else None,
            gate_up_bias=reader.fused([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]) if mlp else None,
            down_bias=reader.read(p + "mlp.down_proj.bias") if mlp else None,
        ))
    embed = reader.read("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else reader.read("lm_head.weight")
    return Weights(embed=embed, layers=layers, norm=reader.read("model.norm.weight"), lm_head=lm_head)


def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> Weights:
    """Weights of the right shapes drawn from N(0, 0.02), norms at 1, made on `device` directly:
    the same work per token as the real checkpoint, for benchmarks without a download."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(*shape):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    qkv_rows = config.q_dim + 2 * config.kv_dim
    attn, mlp = config.attention_bias, config.mlp_bias
    layers = [LayerWeights(ones(h), normal(qkv_rows, h), normal(h, config.q_dim), ones(h), normal(2 * i, h), normal(h, i),
                           qkv_bias=normal(qkv_rows) if attn else None, o_bias=normal(h) if attn else None,
                           gate_up_bias=normal(2 * i) if mlp else None, down_bias=normal(h) if mlp else None)
              for _ in range(config.num_layers)]
    embed = normal(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else normal(config.vocab_size, h)
    return Weights(embed, layers, ones(h), lm_head)
