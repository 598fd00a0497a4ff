"""What the network looks like (ModelConfig, from config.json): the one source of truth for every
size of the model the Python code and the CUDA kernels use (the cache's: core/geometry.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.config_checks import check_config
from pagedcli.model.families import family_of
from pagedcli.model.files import read_json
from pagedcli.model.rope import REQUIRED_FIELDS

DEFAULT_MAX_POSITIONS = 2048  # max_position_embeddings when config.json has none (transformers' default)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the rope parameters (rope_type and its fields); None for default
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"  # its family (model/families/)
    qkv_bias: bool = False  # the q, k and v projections have biases
    o_bias: bool = False  # the o projection has a bias
    mlp_bias: bool = False  # gate, up and down projections have biases
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    sliding_window: int | None = None  # a token attends to the last this many positions, itself included (Mistral)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def context_length(self) -> int:
        """The longest sequence the positions serve: max_position_embeddings, which dynamic NTK
        (whose max_position_embeddings is the trained length) stretches by its factor."""
        if self.rope_type == "dynamic":
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * i + 2 * h
        per_layer += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        if self.mlp_bias:
            per_layer += 2 * i + h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        check_config(d, source)
        family = family_of(d, source).settings(d, source)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise RunError(f"{source}: hidden_act {act!r} is not supported", "Llama uses silu")
        rope_theta, rope_scaling = rope_settings(d, source)
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            cfg = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                **family,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=token_ids(d.get("eos_token_id")),
                raw=d,
            )
        except KeyError as e:
            raise RunError(f"{source}: required key {e.args[0]!r} is missing", "is this a config.json of a supported architecture?") from None
        except (TypeError, ValueError) as e:
            raise RunError(f"{source}: a value has the wrong type ({e})", "is this a config.json of a supported architecture?") from None
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        path = Path(path)
        if not path.exists():
            raise UsageError(f"{path} not found", "a model folder needs a config.json")
        return cls.from_dict(read_json(path), source=str(path))


def rope_settings(d: dict, source: str) -> tuple[float, dict | None]:
    """config.json's RoPE settings as (rope_theta, parameters or None for the default type), read
    as transformers reads them: `rope_scaling`, or transformers 5's `rope_parameters` (which holds
    the theta too); the type as `rope_type` or `type`."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})  # an object: config_checks saw to it
    theta = rope.pop("rope_theta", None)
    theta = d.get("rope_theta", 10000.0) if theta is None else theta
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if rope_type not in REQUIRED_FIELDS:
        raise RunError(f"{source}: rope scaling type {rope_type!r} is not supported",
                       f"supported: {', '.join(REQUIRED_FIELDS)}")
    for name in REQUIRED_FIELDS[rope_type]:  # (yarn's factor may be null: max / original length then)
        value = rope.get(name)
        if name not in rope or not (isinstance(value, (int, float)) or (rope_type == "yarn" and value is None)):
            raise RunError(f"{source}: rope scaling type {rope_type!r} needs a number {name!r}"
                           + ("" if name not in rope else f", not {value!r}"), "is this config.json complete?")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise RunError(f"{source}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported",
                       "Llama rotates whole heads")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise RunError(f"{source}: rope_theta {theta!r} is not a positive number")
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn"):  # transformers' default: the length it was trained at
        rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    return float(theta), {"rope_type": rope_type, **rope}



def token_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` entry (none, one id, or a list) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
