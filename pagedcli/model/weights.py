"""safetensors -> the tensors `Llama` computes with.

Tensors are read one at a time from memory-mapped files straight into their final dtype and
device, q/k/v and gate/up into fused matrices (one GEMM instead of three or two), so the model is
never held twice in memory.

FP8 (model/fp8.py): with `quantization` fp8 the linear layers (q/k/v, o, gate/up, down) and the LM
head become `Fp8Weight`s, quantized as they are read (a tied LM head as an fp8 copy of the
embedding table, which stays for lookups: docs/performance-log.md, "FP8", measured that it pays; a
vocabulary that is not a multiple of FP8_MMA_MULTIPLE keeps its LM head in the model dtype, which
the fp8 GEMMs past 2 rows could not serve). A checkpoint whose config.json has a
quantization_config of quant_method fp8 (or compressed-tensors' fp8) ships them as e4m3 values
with a `weight_scale` each (per tensor or per output channel, as vLLM's and llm-compressor's
checkpoints name them), kept as they are, or dequantized to the model dtype when `quantization` is
none; what such a checkpoint left in float (its ignore list, usually the LM head) is quantized at
load with `quantization` fp8, like a float checkpoint's layers. The embeddings and norms stay in
the model dtype. K/V scales a checkpoint ships (`self_attn.k_scale`, `self_attn.v_scale`, vLLM's
names) come along for an fp8 KV cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedcli.core.errors import RunError, UsageError, plural, show_value
from pagedcli.core.fp8 import FP8_DTYPE, KVScales
from pagedcli.model.config import ModelConfig
from pagedcli.model.files import read_json
from pagedcli.model.fp8 import FP8_MMA_MULTIPLE, Fp8Weight, quantize_weight
from pagedcli.model.host_memory import check_weights_fit, quant_linear_bytes
from pagedcli.model.hub_quant import packed_scheme
from pagedcli.model.quant import QuantWeight, cat_quant, describe, quantize
from pagedcli.model.sharding import shard_layer, shard_vocab

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of what a weight may be stored as
FP8_STORED = "F8_E4M3"  # safetensors' name of float8_e4m3fn: an fp8 checkpoint's linear weights
LINEAR_NAMES = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # the linear layers: a tensor in the model dtype, or an Fp8Weight or QuantWeight of the same [out, in] shape
    qkv: torch.Tensor | Fp8Weight | QuantWeight  # [q_dim + 2 kv_dim, hidden]
    o: torch.Tensor | Fp8Weight | QuantWeight  # [hidden, q_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | Fp8Weight | QuantWeight  # [2 intermediate, hidden]
    down: torch.Tensor | Fp8Weight | QuantWeight  # [hidden, intermediate]
    # biases, where the family or config.json has them (ModelConfig's qkv_bias, o_bias, mlp_bias), fused
    # like their weights
    qkv_bias: torch.Tensor | None = None  # [q_dim + 2 kv_dim]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 intermediate]
    down_bias: torch.Tensor | None = None  # [hidden]
    # Qwen3's RMSNorm weights over each head of q and of k (ModelConfig.qk_norm)
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]

    @property
    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.q_norm is None else (self.q_norm, self.k_norm)


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor | Fp8Weight | QuantWeight  # [vocab, hidden]; the same tensor as embed when tied (and not quantized)
    kv_scales: KVScales | None = None  # K/V scales the checkpoint ships (for an fp8 KV cache)

    @property
    def nbytes(self) -> int:
        """Bytes of distinct weight tensors (an lm_head that is the embedding table counts once); an
        fp8 weight counts its byte a value and its float32 scales."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [w for l in self.layers for w in vars(l).values()]:
            if t is None:
                continue
            if isinstance(t, (Fp8Weight, QuantWeight)):
                total += t.nbytes
            elif t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    @property
    def quantized(self) -> bool:
        return any(isinstance(w, Fp8Weight) for l in self.layers for w in vars(l).values())

    def float_linears(self) -> int:
        """Linear layers (q/k/v, o, gate/up and down of every layer) still in the model dtype."""
        return sum(isinstance(w, torch.Tensor) for l in self.layers for w in (l.qkv, l.o, l.gate_up, l.down))

    @property
    def format(self) -> str:
        """The linear layers' and the LM head's format for people: `bfloat16`, `fp8 (per channel)`,
        `int4 (groups 64 and 128, asymmetric)`, `Q4_K, Q6_K`, ... (a layer left in float named too)."""
        matrices = [w for l in self.layers for w in (l.qkv, l.o, l.gate_up, l.down)] + [self.lm_head]
        names = [str(w.dtype).removeprefix("torch.") for w in matrices if isinstance(w, torch.Tensor)]
        if any(isinstance(w, Fp8Weight) for w in matrices):
            names.append("fp8 (per channel)")
        packed = describe([w for w in matrices if isinstance(w, QuantWeight)])
        return ", ".join(dict.fromkeys(([packed] if packed else []) + names))


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
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (c.q_dim,), p + "self_attn.k_proj.bias": (c.kv_dim,),
                       p + "self_attn.v_proj.bias": (c.kv_dim,)}
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (c.intermediate_size,), p + "mlp.up_proj.bias": (c.intermediate_size,),
                       p + "mlp.down_proj.bias": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise RunError(f"{index}: weight_map {show_value(weight_map)} is not an object naming the tensors' files",
                           "download the checkpoint again")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise RunError(f"{index}: weight_map entry {bad[0]!r} is {show_value(bad[1])}, not a file name",
                           "download the checkpoint again")
        return [_shard(folder, index, name) for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise RunError(f"no model.safetensors in {folder}", "the folder needs model.safetensors or a sharded index")


def _shard(folder: Path, index: Path, name: str) -> Path:
    """An index entry, refused unless it names a file inside the model folder: the index is data
    from the folder, and nothing outside the folder is opened on its word."""
    inside = [folder.resolve()]
    if folder.resolve().parent.name == "snapshots":  # a Hugging Face cache snapshot links into its repo's blobs
        inside.append(folder.resolve().parent.parent / "blobs")
    relative = Path(name)
    target = (folder / relative).resolve()
    if (not name or relative.is_absolute() or ".." in relative.parts
            or not any(target.is_relative_to(root) for root in inside)):
        raise RunError(f"{index}: entry {name!r} points outside the model folder {folder}",
                       "a sharded index names files beside it; download the checkpoint again")
    return folder / relative


class _TensorReader:
    """Looks tensors up across shards; checks the layers, and every tensor's dtype and shape,
    before reading any, and each tensor's values as it is read."""

    def __init__(self, files: list[Path], config: ModelConfig, dtype, device):
        self.dtype, self.device = dtype, device
        self.handles, self.where = [], {}
        for path in files:
            if not path.is_file():
                why = ("is a folder, not a file" if path.is_dir() else "is missing" if not path.exists()
                       else "is not a regular file (a device, a pipe or a socket)")
                raise RunError(f"weights file {path} {why}", "download the checkpoint again")
            try:
                handle = safe_open(str(path), framework="pt")
                self.handles.append(handle)
                for name in handle.keys():
                    self.where[name] = handle
            except (SafetensorError, OSError, ValueError) as e:
                raise RunError(f"{path} is not a readable safetensors file ({_first_line(e)})",
                               "download the checkpoint again") from None
        folder = files[0].parent
        self.packed = packed_scheme(config)  # AWQ, GPTQ, compressed-tensors' 4-bit (model/hub_quant.py)
        self.fp8 = self.packed is None and fp8_checkpoint(config)
        self._check_layers(config, folder)
        self.shapes = shapes = expected_shapes(config)
        missing = [n for n in shapes if n not in self.where and not self.is_packed(n)]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise RunError(f"tensor {missing[0]}{more} missing from {folder}", "is this a Llama checkpoint?")
        for name in shapes:  # from the headers, before any tensor is allocated or read
            if self.is_packed(name):
                self.packed.check(self.where, name, shapes[name])
            else:
                self._check_header(name)

    def _check_layers(self, config: ModelConfig, folder: Path) -> None:
        """The checkpoint's layers are the config's: a layer more would go unused (and the output
        be wrong without a word), a layer less is missing."""
        layers = {int(m.group(1)) for m in map(LAYER_NAME.match, self.where) if m}
        have = max(layers) + 1 if layers else 0
        if have > config.num_layers:
            unused = sorted(n for n in self.where if (m := LAYER_NAME.match(n)) and int(m.group(1)) >= config.num_layers)
            raise RunError(f"{folder} holds {plural(have, 'layer')} but config.json's num_hidden_layers is {config.num_layers}: "
                           f"{len(unused)} tensors would go unused ({unused[0]}, ...)",
                           "fix num_hidden_layers in config.json")
        if have < config.num_layers:
            raise RunError(f"config.json's num_hidden_layers is {config.num_layers}, but {folder} holds {plural(have, 'layer')}",
                           "fix num_hidden_layers in config.json, or download the checkpoint again")

    def _check_header(self, name: str) -> None:
        try:
            tensor_slice = self.where[name].get_slice(name)
            stored, shape = tensor_slice.get_dtype(), tuple(tensor_slice.get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise RunError(f"tensor {name} could not be read ({_first_line(e)})",
                           "the file may be truncated; download it again") from None
        if stored == FP8_STORED and LINEAR_NAMES.search(name):
            if not self.fp8:
                raise RunError(f"tensor {name} holds fp8 values but config.json has no quantization_config "
                               "of quant_method fp8", "the checkpoint's config.json is not its own; download it again")
            self._check_scale(name, shape)
        elif stored not in FLOAT_DTYPES:
            raise RunError(f"tensor {name} holds {stored} values, not floating point",
                           "pagedcli reads float weights, and fp8 ones (quantization_config of quant_method fp8)")
        if shape != self.shapes[name]:
            raise RunError(f"tensor {name} has shape {list(shape)}, config.json implies {list(self.shapes[name])}")

    def _check_scale(self, name: str, shape: tuple[int, ...]) -> None:
        """An fp8 weight's `weight_scale`: per tensor ([] or [1]) or per output channel ([out] or
        [out, 1]); block-wise scales (weight_scale_inv) are refused by fp8_checkpoint already."""
        scale = name + "_scale"
        if scale not in self.where:
            raise RunError(f"tensor {name} holds fp8 values but {scale} is missing",
                           "pagedcli reads fp8 checkpoints with a weight_scale per weight; download it again")
        got = tuple(self.where[scale].get_slice(scale).get_shape())
        if got not in ((), (1,), (shape[0],), (shape[0], 1)):
            raise RunError(f"tensor {scale} has shape {list(got)}: pagedcli reads per-tensor ([] or [1]) or "
                           f"per-channel ([{shape[0]}] or [{shape[0]}, 1]) fp8 scales",
                           "use a checkpoint with per-tensor or per-channel scales, or its float original with "
                           "`quantization` fp8")

    def is_packed(self, name: str) -> bool:
        """Whether `name` is stored 4-bit packed (its float name absent: `qweight` and the rest)."""
        return self.packed is not None and name not in self.where and self.packed.stores(self.where, name)

    def is_fp8(self, name: str) -> bool:
        return self.fp8 and self.where[name].get_slice(name).get_dtype() == FP8_STORED

    def read_into(self, name: str, out: torch.Tensor) -> None:
        handle = self.where[name]
        try:
            out.copy_(handle.get_tensor(name))
        except (SafetensorError, OSError, ValueError) as e:
            raise RunError(f"tensor {name} could not be read ({_first_line(e)})",
                           "the file may be truncated; download it again") from None
        if not torch.isfinite(out).all():  # one pass per tensor, as it is read
            self._not_finite(name, handle.get_tensor(name))

    def _not_finite(self, name: str, stored: torch.Tensor) -> None:
        if torch.isfinite(stored).all():  # finite in the file: the load dtype cannot hold it
            big = stored.abs().max().item()
            hint = ("use `dtype` bfloat16 (float16 ends at 65504)" if self.dtype == torch.float16
                    else "the checkpoint is damaged; download it again")
            raise RunError(f"tensor {name} has values beyond {str(self.dtype).removeprefix('torch.')}'s range "
                           f"(up to {big:.3g})", hint)
        nan, inf = int(stored.isnan().sum()), int(stored.isinf().sum())
        what = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n)
        raise RunError(f"tensor {name} holds {what} value{'s' * (nan + inf > 1)} of {stored.numel()}",
                       "the checkpoint is damaged; download it again")

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
        self.read_into(name, out)
        return out

    def _read_fp8_into(self, name: str, values: torch.Tensor, scale: torch.Tensor) -> None:
        """An fp8 checkpoint's weight into `values` (e4m3, as stored) and its weight_scale, per
        tensor or per channel, into `scale` ([rows] float32)."""
        try:
            values.copy_(self.where[name].get_tensor(name))
            stored = self.where[name + "_scale"].get_tensor(name + "_scale").float().reshape(-1)
        except (SafetensorError, OSError, ValueError) as e:
            raise RunError(f"tensor {name} could not be read ({_first_line(e)})",
                           "the file may be truncated; download it again") from None
        if values.isnan().any():
            raise RunError(f"tensor {name} holds NaN values", "the checkpoint is damaged; download it again")
        if not (torch.isfinite(stored).all() and (stored > 0).all()):
            raise RunError(f"tensor {name}_scale holds a scale that is not a positive number",
                           "the checkpoint is damaged; download it again")
        scale.copy_(stored.expand(scale.shape[0]))

    def linear(self, names: list[str], quantization: str = "none") -> torch.Tensor | Fp8Weight | QuantWeight:
        """The fused weight of `names`: in the model dtype, or as `quantization` fp8 (an Fp8Weight)
        or int4 / int8 (a QuantWeight: model/quant.py) makes it. Float tensors are quantized here; an
        fp8 checkpoint's values and scales are taken as they are (dequantized to the model dtype
        unless `quantization` fp8); a 4-bit checkpoint's packed weights become QuantWeights as they
        are (dequantized where a fused matrix mixes them with float ones or other groups)."""
        if self.packed is not None and any(self.is_packed(n) for n in names):
            return self._packed_linear(names)
        if not any(self.is_fp8(n) for n in names):
            w = self.fused(names)
            if quantization in ("int4", "int8"):
                return quantize(w, quantization) or w
            return quantize_weight(w) if quantization == "fp8" else w
        if quantization in ("int4", "int8"):  # an fp8 checkpoint's weights, dequantized, then quantized so
            w = self.linear(names)
            return quantize(w, quantization) or w
        rows = [self.shapes[n][0] for n in names]
        values = torch.empty((sum(rows),) + self.shapes[names[0]][1:], dtype=FP8_DTYPE, device=self.device)
        scale = torch.empty(sum(rows), dtype=torch.float32, device=self.device)
        for name, part, part_scale in zip(names, values.split(rows), scale.split(rows)):
            if self.is_fp8(name):
                self._read_fp8_into(name, part, part_scale)
            else:  # a layer the quantizer left in float (its ignored_layers), beside fp8 ones
                q = quantize_weight(self.read(name))
                part.copy_(q.values)
                part_scale.copy_(q.scale)
        w = Fp8Weight(values, scale)
        return w if quantization == "fp8" else w.dequantize(self.dtype)

    def _packed_linear(self, names: list[str]) -> QuantWeight | torch.Tensor:
        parts = [self.packed.read(self.where, n, self.shapes[n], self.device) if self.is_packed(n) else self.read(n)
                 for n in names]
        if all(isinstance(p, QuantWeight) and p.group == parts[0].group for p in parts):
            return parts[0] if len(parts) == 1 else cat_quant(parts)
        return torch.cat([p.dequantize(self.dtype) if isinstance(p, QuantWeight) else p for p in parts])

    def kv_scales(self, config: ModelConfig) -> KVScales | None:
        """The checkpoint's K/V scales (vLLM's `self_attn.k_scale`, `self_attn.v_scale`: one per
        layer, or one per KV head), or None when it has none."""
        names = [f"model.layers.{i}.self_attn.{x}_scale" for x in "kv" for i in range(config.num_layers)]
        have = [n for n in names if n in self.where]
        if not have:
            return None
        if len(have) < len(names):
            missing = next(n for n in names if n not in self.where)
            raise RunError(f"tensor {missing} missing: the checkpoint ships K/V scales for some layers only",
                           "download the checkpoint again")
        out = torch.ones((2, config.num_layers, config.num_kv_heads), dtype=torch.float32)
        for n, row in zip(names, out.view(2 * config.num_layers, config.num_kv_heads)):
            t = self.where[n].get_tensor(n).float().reshape(-1)
            if t.numel() not in (1, config.num_kv_heads):
                raise RunError(f"tensor {n} has {t.numel()} values: a K/V scale is one per layer or one per KV head "
                               f"({config.num_kv_heads})")
            if not (torch.isfinite(t).all() and (t > 0).all()):
                raise RunError(f"tensor {n} holds a scale that is not a positive number",
                               "the checkpoint is damaged; download it again")
            row.copy_(t.expand(config.num_kv_heads))
        return KVScales(out[0].to(self.device), out[1].to(self.device))

    def fused(self, names: list[str]) -> torch.Tensor:
        rows = [self.shapes[n][0] for n in names]
        out = torch.empty((sum(rows),) + self.shapes[names[0]][1:], dtype=self.dtype, device=self.device)
        for name, part in zip(names, out.split(rows)):
            self.read_into(name, part)
        return out


def fp8_checkpoint(config: ModelConfig) -> bool:
    """Whether config.json says the checkpoint ships fp8 weights: a quantization_config of quant_method
    fp8 (vLLM's, transformers'), or compressed-tensors with 8-bit float weights, e4m3, scales per
    tensor or per channel. Any other quantization, block-wise scales included, is refused here."""
    q = config.raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(q)
    if method != "fp8":
        raise RunError(f"config.json: quantization_config's quant_method {show_value(method)} is not supported",
                       "pagedcli reads float checkpoints, fp8 ones (quant_method fp8) and 4-bit awq, gptq and "
                       "compressed-tensors ones")
    if q.get("weight_block_size") is not None:
        raise RunError(f"config.json: block-wise fp8 scales (weight_block_size {show_value(q['weight_block_size'])}) "
                       "are not supported", BLOCK_WISE_HINT)
    if q.get("fmt", "e4m3") != "e4m3":
        raise RunError(f"config.json: fp8 format {show_value(q.get('fmt'))} is not supported", "pagedcli reads e4m3")
    return True


BLOCK_WISE_HINT = "use a checkpoint with per-tensor or per-channel scales, or its float original with `quantization` fp8"


def _compressed_tensors_fp8(q: dict) -> bool:
    """compressed-tensors' config_groups: every group's weights 8-bit floats, per tensor or channel."""
    groups = q.get("config_groups")
    schemes = [g.get("weights") if isinstance(g, dict) else None for g in groups.values()] if isinstance(groups, dict) else []
    for w in schemes or [None]:
        if not isinstance(w, dict) or w.get("num_bits") != 8 or w.get("type") != "float":
            raise RunError(f"config.json: compressed-tensors weights {show_value(w)} are not supported",
                           "pagedcli reads 8-bit float (fp8) weights")
        if w.get("strategy") not in ("tensor", "channel"):
            raise RunError(f"config.json: compressed-tensors fp8 scales of strategy {show_value(w.get('strategy'))} "
                           "are not supported", BLOCK_WISE_HINT)
    return True


def fp8_lm_head(config: ModelConfig) -> bool:
    """Whether `quantization` fp8 takes the LM head to fp8 too: where the fp8 GEMMs can serve it past
    2 rows (its vocabulary a multiple of FP8_MMA_MULTIPLE); otherwise torch's float32 product would
    take it there, slower than the model dtype's GEMM."""
    return config.vocab_size % FP8_MMA_MULTIPLE == 0


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype, device, quantization: str = "none",
                 shard: tuple[int, int] = (1, 0)) -> Weights:
    """`quantization` fp8: the linear layers and the LM head as Fp8Weights (model/fp8.py); int4 /
    int8: as QuantWeights (model/quant.py). A 4-bit checkpoint's (model/hub_quant.py) linear layers
    are QuantWeights as they are stored. `shard` (world, rank): only that rank's share, taken layer by
    layer as it is read (model/sharding.py)."""
    reader = _TensorReader(safetensors_files(Path(folder)), config, dtype, device)
    if reader.packed is not None and quantization != "none":
        raise UsageError(f"`quantization` {quantization}: the checkpoint's linear layers are {reader.packed.method} "
                         "4-bit already", "leave out `quantization`")
    # (the checkpoint's headers agree with config.json by now)
    check_weights_fit(config, dtype, device, *host_bytes("4-bit" if reader.packed is not None else quantization, dtype))
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        mlp = config.mlp_bias
        layers.append(shard_layer(LayerWeights(
            input_norm=reader.read(p + "input_layernorm.weight"),
            qkv=reader.linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"], quantization),
            o=reader.linear([p + "self_attn.o_proj.weight"], quantization),
            post_norm=reader.read(p + "post_attention_layernorm.weight"),
            gate_up=reader.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], quantization),
            down=reader.linear([p + "mlp.down_proj.weight"], quantization),
            qkv_bias=reader.fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"]) if config.qkv_bias else None,
            o_bias=reader.read(p + "self_attn.o_proj.bias") if config.o_bias else None,
            gate_up_bias=reader.fused([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]) if mlp else None,
            down_bias=reader.read(p + "mlp.down_proj.bias") if mlp else None,
            q_norm=reader.read(p + "self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=reader.read(p + "self_attn.k_norm.weight") if config.qk_norm else None,
        ), config, *shard))
    embed = reader.read("model.embed_tokens.weight")
    if quantization != "none" and fp8_lm_head(config):  # a copy of its own when tied (the table stays for lookups)
        lm_head = (quantize_lm_head(embed, quantization) if config.tie_word_embeddings
                   else reader.linear(["lm_head.weight"], quantization))
    elif config.tie_word_embeddings:
        lm_head = embed
    else:  # (a 4-bit checkpoint's packed LM head as it is stored)
        lm_head = reader.linear(["lm_head.weight"]) if reader.is_packed("lm_head.weight") else reader.read("lm_head.weight")
    return shard_vocab(Weights(embed=embed, layers=layers, norm=reader.read("model.norm.weight"), lm_head=lm_head,
                               kv_scales=reader.kv_scales(config)), config, *shard)


def quantize_lm_head(w: torch.Tensor, quantization: str) -> torch.Tensor | Fp8Weight | QuantWeight:
    """The LM head as `quantization` makes the linear layers (the same rule as fp8's: fp8_lm_head)."""
    if quantization == "fp8":
        return quantize_weight(w)
    return quantize(w, quantization) or w


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def host_bytes(weights: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """(bytes a linear weight on the host, the format's name) for check_weights_fit: `weights` is
    `quantization` (none, fp8, int4, int8) or 4-bit (a packed checkpoint)."""
    bits = {"int4": 4, "4-bit": 4, "int8": 8}.get(weights)
    if bits is not None:
        return quant_linear_bytes(bits, dtype), weights
    return (1.0, "fp8") if weights == "fp8" else (None, "")


def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0, quantization: str = "none",
                   shard: tuple[int, int] = (1, 0)) -> Weights:
    """Weights of the right shapes drawn from N(0, 0.02), norms at 1, made on `device` directly:
    the same work per token as the real checkpoint, for benchmarks without a download
    (`quantization` fp8: the linear layers and the LM head quantized as they are made). `shard`
    (world, rank): that rank's share of the same weights, a layer at a time."""
    check_weights_fit(config, dtype, device, *host_bytes(quantization, dtype))
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(*shape):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    def linear(*shape):
        return normal(*shape) if quantization == "none" else quantize_lm_head(normal(*shape), quantization)

    qkv_rows = config.q_dim + 2 * config.kv_dim
    c, d = config, config.head_dim

    def layer() -> LayerWeights:  # (drawn in the order of the fields: the same weights at any `shard`)
        return LayerWeights(ones(h), linear(qkv_rows, h), linear(h, c.q_dim), ones(h), linear(2 * i, h), linear(h, i),
                            qkv_bias=normal(qkv_rows) if c.qkv_bias else None, o_bias=normal(h) if c.o_bias else None,
                            gate_up_bias=normal(2 * i) if c.mlp_bias else None,
                            down_bias=normal(h) if c.mlp_bias else None,
                            q_norm=ones(d) if c.qk_norm else None, k_norm=ones(d) if c.qk_norm else None)

    layers = [shard_layer(layer(), config, *shard) for _ in range(c.num_layers)]
    embed = normal(config.vocab_size, h)
    lm_head = embed if config.tie_word_embeddings else normal(config.vocab_size, h)
    if quantization != "none" and fp8_lm_head(config):
        lm_head = quantize_lm_head(lm_head, quantization)
    return shard_vocab(Weights(embed, layers, ones(h), lm_head), config, *shard)
