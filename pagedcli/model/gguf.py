"""`--model file.gguf` (llama.cpp's format, what ollama and LM Studio download): the config from the
file's metadata, its weights as the `Weights` model/weights.py makes (the tokenizer:
gguf_tokenizer.py; the header: gguf_file.py; the quant blocks: gguf_quants.py).

Linear layers and the LM head stay compressed as QuantWeights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K); F32, F16 and BF16 tensors, the norms, the biases and the embedding table (read by lookups)
are in the model dtype. llama.cpp's converter permutes the rows of a llama's q and k weights
(interleaved RoPE pairs); the permutation is undone here, as transformers' GGUF loader undoes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedcli.core.errors import RunError, UsageError, plural
from pagedcli.model.config import ModelConfig
from pagedcli.model.gguf_file import MAGIC, GGUFFile
from pagedcli.model.gguf_quants import FLOATS, QUANTIZED, SUPPORTED, decode, floats
from pagedcli.model.host_memory import check_weights_fit, quant_linear_bytes
from pagedcli.model.quant import QuantWeight, cat_quant
from pagedcli.model.weights import LayerWeights, Weights, expected_shapes

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = ("llama",)  # the architectures whose q/k rows llama.cpp's converter permutes
# GGUF metadata -> the sampling settings generation_config.json would give
SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k", "general.sampling.top_p": "top_p"}
# Llama 3.1+'s RoPE scaling, which llama.cpp stores as a tensor of per-pair factors (rope_freqs.weight)
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gguf_path(path: Path, spec: str) -> Path | None:
    """The GGUF file `path` names: the file itself (.gguf, or any file that starts as GGUF does:
    ollama keeps its models as blobs named by their hash), or the one .gguf in a folder without a
    config.json; None when it names neither."""
    if path.is_file() and (path.suffix.lower() == ".gguf" or _starts_as_gguf(path)):
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise UsageError(f"`model` {spec}: the folder holds {len(found)} GGUF files ({names})",
                         "pass the one to run, e.g. `model` " + str(found[0]))
    return found[0] if found else None


def _starts_as_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass
class GGUFModel:
    file: GGUFFile
    config: ModelConfig
    generation_config: dict


def read_gguf(path: Path) -> GGUFModel:
    f = GGUFFile(path)
    parts = f.metadata.get("split.count")
    if isinstance(parts, int) and parts > 1:  # (llama.cpp's gguf-split: each part holds some of the tensors)
        raise RunError(f"{path} is part {f.metadata.get('split.no', 0) + 1} of a GGUF split in {parts} files",
                       "merge them into one with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`")
    config = ModelConfig.from_dict(config_dict(f), source=str(path))
    return GGUFModel(f, config, generation_config(f.metadata))


def config_dict(f: GGUFFile) -> dict:
    """The metadata as config.json would say it (transformers' GGUF_CONFIG_MAPPING), checked under
    the metadata's own key names."""
    meta, source = f.metadata, str(f.path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise RunError(f"{source}: architecture {arch!r} is not supported", f"pagedcli runs GGUF files of "
                       f"{', '.join(ARCHITECTURES)}")

    def number(key: str, default=None, kind=int):
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, np.ndarray) and value.size and (value == value.flat[0]).all():
            value = value.flat[0].item()  # a per-layer list, all alike
        if value is None:
            raise RunError(f"{source}: metadata {arch}.{key} is missing", "is this a GGUF file of a language model?")
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1 if kind is int
              else isinstance(value, (int, float)) and math.isfinite(value) and value >= 0)
        if not ok:
            raise RunError(f"{source}: metadata {arch}.{key} {value!r} is not a "
                           f"{'whole number of at least 1' if kind is int else 'number of at least 0'}",
                           "download the file again")
        return value

    tokens = meta.get("tokenizer.ggml.tokens")
    embed = f.tensors.get("token_embd.weight")
    vocab = embed.shape[0] if embed is not None else number("vocab_size", len(tokens) if tokens else None)
    hidden, heads = number("embedding_length"), number("attention.head_count")
    d = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
         "intermediate_size": number("feed_forward_length"), "num_hidden_layers": number("block_count"),
         "num_attention_heads": heads, "num_key_value_heads": number("attention.head_count_kv", heads),
         "head_dim": number("attention.key_length", hidden // heads),
         "max_position_embeddings": number("context_length"),
         "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-5, float),
         "rope_theta": number("rope.freq_base", 10000.0, float),
         "tie_word_embeddings": "output.weight" not in f.tensors}
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != d["head_dim"]:
        raise RunError(f"{source}: {arch}.rope.dimension_count {rotary} rotates part of each head of {d['head_dim']}",
                       "pagedcli rotates whole heads")
    if arch == "llama":  # biases where the file has them (Llama's attention_bias / mlp_bias)
        d["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        d["mlp_bias"] = "blk.0.ffn_gate.bias" in f.tensors
    rope = rope_scaling(f, arch, d)
    if rope is not None:
        d["rope_scaling"] = rope
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < vocab:
            d[field] = value
    return d


def rope_scaling(f: GGUFFile, arch: str, d: dict) -> dict | None:
    """{arch}.rope.scaling.* (linear, yarn) as config.json's rope_scaling; Llama 3's, stored as
    rope_freqs.weight, recognised by its factors (those of Llama 3.1 / 3.2's low and high frequency
    factors 1 and 4 at 8,192 positions: the file keeps the factors, not the settings)."""
    meta, source = f.metadata, str(f.path)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original or
                d["max_position_embeddings"]}
    if kind != "none":
        raise RunError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported", "supported: none, linear, yarn")
    if "rope_freqs.weight" not in f.tensors:
        return None
    info = f.tensors["rope_freqs.weight"]
    if info.kind != "F32" or info.shape != (d["head_dim"] // 2,):
        raise RunError(f"{source}: rope_freqs.weight is {info.kind} {list(info.shape)}, not F32 [{d['head_dim'] // 2}]",
                       "download the file again")
    stored = floats(f.raw("rope_freqs.weight"), "F32", info.shape).double()
    settings = {"rope_type": "llama3", "factor": float(stored.max()), **LLAMA3_ROPE}
    if not torch.allclose(llama3_factors(d["rope_theta"], d["head_dim"], settings), stored, rtol=1e-5):
        raise RunError(f"{source}: rope_freqs.weight holds RoPE factors other than Llama 3's",
                       "pagedcli reads Llama 3's RoPE scaling (low 1, high 4, 8,192 positions) and linear and yarn")
    return settings


def llama3_factors(theta: float, head_dim: int, s: dict) -> torch.Tensor:
    """What llama.cpp's converter writes as rope_freqs.weight: each pair's frequency divisor."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, blended))


def generation_config(meta: dict) -> dict:
    """The sampling settings the file recommends (general.sampling.*), as generation_config.json
    gives them; stop ids: eos, and llama.cpp's end-of-turn / end-of-message tokens."""
    out = {SAMPLING[k]: meta[k] for k in SAMPLING if isinstance(meta.get(k), (int, float))}
    if out:
        # greedy only at temperature 0: any other value (a NaN, a negative) goes on to be checked where
        # it is used (commands/generate.py sampling_defaults), and refused there in one line
        out["do_sample"] = out.get("temperature", 1.0) != 0
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(s for s in stops if isinstance(s, int) and s >= 0))
    if stops:
        out["eos_token_id"] = stops
    return out


# --- weights ----------------------------------------------------------------------------------------

def gguf_name(hf_name: str) -> str:
    """transformers' tensor name -> llama.cpp's."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    short = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}[part]
    return f"blk.{layer}.{short}.{kind}"


class _Reader:
    """The file's tensors by transformers' names, every one checked (present, its type readable, its
    shape the config's) before any is decoded."""

    def __init__(self, model: GGUFModel, dtype: torch.dtype, device):
        self.f, self.config, self.dtype, self.device = model.file, model.config, dtype, device
        self.source = str(self.f.path)
        self.shapes = expected_shapes(model.config)
        self.permuted = model.config.raw.get("model_type") in PERMUTED
        layers = {int(n.split(".")[1]) for n in self.f.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
        if layers and max(layers) + 1 != model.config.num_layers:
            raise RunError(f"{self.source} holds {plural(max(layers) + 1, 'layer')}, but its {model.config.raw['model_type']}"
                           f".block_count is {model.config.num_layers}", "download the file again")
        for name, shape in self.shapes.items():
            info = self.f.tensors.get(gguf_name(name))
            if info is None:
                raise RunError(f"{self.source}: tensor {gguf_name(name)} is missing",
                               "is this a GGUF file of the architecture its metadata names?")
            if info.kind not in SUPPORTED:
                raise RunError(f"{self.source}: tensor {info.name} is {info.kind}, a quant type pagedcli does not read",
                               f"supported: {', '.join(SUPPORTED)}; pick a file of one of them")
            if info.shape != shape:
                raise RunError(f"{self.source}: tensor {info.name} has shape {list(info.shape)}, the metadata implies "
                               f"{list(shape)}", "download the file again")

    def _rows(self, name: str) -> torch.Tensor | None:
        """The inverse of llama.cpp's q/k row permutation (each head's rows taken back from
        interleaved pairs to halves), as a row index; None for any other tensor."""
        c = self.config
        if not self.permuted or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = c.num_heads if name.endswith("q_proj.weight") else c.num_kv_heads
        rows = self.shapes[name][0]
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)

    def quant(self, name: str) -> QuantWeight | None:
        info = self.f.tensors[gguf_name(name)]
        if info.kind not in QUANTIZED:
            return None
        w = decode(self.f.raw(info.name), info.kind, info.shape)
        for part in (w.scale, w.offset):
            if part is not None and not torch.isfinite(part).all():
                raise RunError(f"{self.source}: tensor {info.name} holds scales that are not finite numbers",
                               "the file is damaged; download it again")
        rows = self._rows(name)
        if rows is not None:  # a whole row moves with its groups' scales
            w = QuantWeight(w.q[rows], w.scale[rows], None if w.offset is None else w.offset[rows], w.bits, w.group,
                            w.source)
        return w

    def dense(self, name: str, decoded: QuantWeight | None = None) -> torch.Tensor:
        """The tensor in the model dtype (`decoded`: its blocks, decoded already)."""
        info = self.f.tensors[gguf_name(name)]
        raw = self.f.raw(info.name)
        if decoded is not None:  # (quant() has permuted its rows already)
            t = decoded.dequantize()
        elif info.kind in FLOATS:
            t = floats(raw, info.kind, info.shape)
        else:
            t = decode(raw, info.kind, info.shape if len(info.shape) == 2 else (1, info.shape[0])).dequantize()
            t = t.view(info.shape)
        rows = self._rows(name)
        if rows is not None and decoded is None:
            t = t[rows]
        out = t.to(device=self.device, dtype=self.dtype)
        if not torch.isfinite(out).all():
            where = "the file" if not torch.isfinite(t).all() else str(self.dtype).removeprefix("torch.") + "'s range"
            raise RunError(f"{self.source}: tensor {info.name} holds values that are not finite in {where}",
                           "use `dtype` float32 or bfloat16" if where != "the file" else "download the file again")
        return out

    def linear(self, names: list[str]) -> torch.Tensor | QuantWeight:
        """The fused weight of `names`: one QuantWeight where all are quantized alike (values of the
        same width and group; a part without offsets gets zeros), else dequantized to the model dtype
        (a Q4_K_M file's Q4_K q and k beside a Q6_K v, say: fused weights are one format)."""
        parts = [self.quant(n) for n in names]
        if all(p is not None for p in parts) and len({(p.bits, p.group) for p in parts}) == 1:
            w = parts[0] if len(parts) == 1 else cat_quant(parts)
            return self.on_device(w)
        return torch.cat([self.dense(n) if p is None else p.dequantize(self.dtype).to(self.device)
                          for n, p in zip(names, parts)])

    def on_device(self, w: QuantWeight) -> QuantWeight:
        return QuantWeight(w.q.to(self.device), w.scale.to(self.device),
                           None if w.offset is None else w.offset.to(self.device), w.bits, w.group, w.source)

    def optional(self, names: list[str], wanted: bool) -> torch.Tensor | None:
        return torch.cat([self.dense(n) for n in names]) if wanted else None


def load_gguf_weights(model: GGUFModel, dtype: torch.dtype, device, quantization: str = "none") -> Weights:
    if quantization != "none":
        raise UsageError(f"`quantization` {quantization}: a GGUF file's weights keep the quant types it was made with",
                         "leave `quantization` out")
    c = model.config
    r = _Reader(model, dtype, device)
    # as a checkpoint's, refused in one line where the host cannot hold them (compressed linear layers
    # counted as 8-bit ones, the widest of the quant types: Q4 files take less)
    linears = [gguf_name(n) for n in r.shapes if n.endswith("proj.weight") or n == "lm_head.weight"]
    if any(r.f.tensors[n].kind in QUANTIZED for n in linears):
        check_weights_fit(c, dtype, device, quant_linear_bytes(8, dtype), "GGUF")
    else:
        check_weights_fit(c, dtype, device)
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=r.dense(p + "input_layernorm.weight"),
            qkv=r.linear([attn + f"{x}_proj.weight" for x in "qkv"]),
            o=r.linear([attn + "o_proj.weight"]),
            post_norm=r.dense(p + "post_attention_layernorm.weight"),
            gate_up=r.linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
            down=r.linear([mlp + "down_proj.weight"]),
            qkv_bias=r.optional([attn + f"{x}_proj.bias" for x in "qkv"], c.qkv_bias),
            o_bias=r.optional([attn + "o_proj.bias"], c.o_bias),
            gate_up_bias=r.optional([mlp + "gate_proj.bias", mlp + "up_proj.bias"], c.mlp_bias),
            down_bias=r.optional([mlp + "down_proj.bias"], c.mlp_bias),
            q_norm=r.optional([attn + "q_norm.weight"], c.qk_norm),
            k_norm=r.optional([attn + "k_norm.weight"], c.qk_norm),
        ))
    blocks = r.quant("model.embed_tokens.weight") if c.tie_word_embeddings else None
    embed = r.dense("model.embed_tokens.weight", blocks)  # looked up by id: in the model dtype
    if c.tie_word_embeddings:  # the LM head: the embedding's own blocks, still compressed
        lm_head = embed if blocks is None else r.on_device(blocks)
    else:
        lm_head = r.linear(["lm_head.weight"])
    return Weights(embed=embed, layers=layers, norm=r.dense("model.norm.weight"), lm_head=lm_head)
