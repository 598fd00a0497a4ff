"""The Hub's 4-bit checkpoints (model/hub_quant.py): AWQ, GPTQ and compressed-tensors packings
written here from known 4-bit values, zero points and scales, read back exactly; a tiny model in each
format generating the same greedy tokens as the same weights dequantized into a float checkpoint;
the refusals, one line each."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import invoke
from pagedcli.core.errors import RunError, UsageError
from pagedcli.core.options import SamplingParams
from pagedcli.model.quant import QuantWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing (its pack(); vLLM's AWQ_REVERSE_ORDER undoes it)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("awq", "gptq", "gptq_v2", "compressed-tensors", "compressed-tensors-asymmetric")


# --- the packings, written as the quantizers write them ------------------------------------------
def words(values: np.ndarray) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: slot i in bits 4i .. 4i + 3."""
    v = values.astype(np.uint64)
    packed = sum(v[..., i] << np.uint64(4 * i) for i in range(8))
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())


def pack_columns(values: np.ndarray) -> torch.Tensor:
    """[r, 8c] -> [r, c], 8 consecutive columns a word."""
    return words(values.reshape(values.shape[0], -1, 8))


def pack_rows(values: np.ndarray) -> torch.Tensor:
    """[8r, c] -> [r, c], 8 consecutive rows a word."""
    return words(values.reshape(-1, 8, values.shape[1]).transpose(0, 2, 1))


def pack_awq(values: np.ndarray) -> torch.Tensor:
    """[r, 8c] -> [r, c], AutoAWQ's GEMM order: slot i of word j holds column 8j + AWQ_ORDER[i]."""
    grouped = values.reshape(values.shape[0], -1, 8)
    return words(grouped[..., list(AWQ_ORDER)])


def known_weight(source: torch.Tensor, group: int):
    """`source` [out, in] rounded to 4 bits as a quantizer would: fp16 scales, zero points in 1..15
    (gptq v1 stores zero - 1), q in 0..15; the weight they make, exact in float32."""
    out, width = source.shape
    grouped = source.float().reshape(out, -1, group)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-3).half()
    zeros = (-low / scales.float()).round().clamp(1, 15).long()
    q = (grouped / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15).long().reshape(out, width)
    w = (q - zeros.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    return q, zeros, scales, w


def packed_tensors(fmt: str, prefix: str, q, zeros, scales) -> dict[str, torch.Tensor]:
    """The tensors `fmt` stores for the weight `prefix`.weight of [out, in] q."""
    q, zeros = q.numpy(), zeros.numpy()
    out, width = q.shape
    groups = zeros.shape[1]
    if fmt == "awq":
        return {prefix + "qweight": pack_awq(q.T), prefix + "qzeros": pack_awq(zeros.T),
                prefix + "scales": scales.T.contiguous()}
    if fmt in ("gptq", "gptq_v2"):
        stored = zeros - 1 if fmt == "gptq" else zeros
        g_idx = torch.arange(width, dtype=torch.int32) // (width // groups)
        return {prefix + "qweight": pack_rows(q.T), prefix + "qzeros": pack_columns(stored.T),
                prefix + "scales": scales.T.contiguous(), prefix + "g_idx": g_idx}
    tensors = {prefix + "weight_packed": pack_columns(q), prefix + "weight_scale": scales,
               prefix + "weight_shape": torch.tensor([out, width], dtype=torch.int64)}
    if fmt == "compressed-tensors-asymmetric":
        tensors[prefix + "weight_zero_point"] = pack_rows(zeros)
    return tensors


def quantization_config(fmt: str, group: int, bits: int = 4) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": False,
                "checkpoint_format": fmt}
    weights = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": group, "dynamic": False,
               "symmetric": fmt == "compressed-tensors"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def write_checkpoint(source, folder, fmt: str, group: int = 32):
    """`source`'s checkpoint with every linear layer rounded to known 4-bit values packed as `fmt`
    (the embeddings, norms and LM head as they were), and beside it `folder`/float: the same weights
    dequantized, a float32 checkpoint. Returns (packed folder, float folder, {name: known w})."""
    tensors = load_file(source / "model.safetensors")
    packed, dense, known = {}, {}, {}
    symmetric = fmt == "compressed-tensors"
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
            q, zeros, scales, w = known_weight(t, group)
            if symmetric:  # compressed-tensors' symmetric values are signed about 0: the unsigned zero is 8
                q = (q - zeros.repeat_interleave(group, 1) + 8).clamp(0, 15)
                zeros = torch.full_like(zeros, 8)
                w = (q - 8) * scales.float().repeat_interleave(group, 1)
            packed |= packed_tensors(fmt, name.removesuffix("weight"), q, zeros, scales)
            dense[name] = known[name] = w
        else:
            packed[name] = dense[name] = t.float()
    for target, content in ((folder / "packed", packed), (folder / "float", dense)):
        shutil.copytree(source, target)
        (target / "model.safetensors").unlink()
        save_file(content, target / "model.safetensors")
    config = json.loads((folder / "packed" / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group)
    (folder / "packed" / "config.json").write_text(json.dumps(config))
    return folder / "packed", folder / "float", known


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama whose every linear layer's inputs are a multiple of 128 (hidden 128, intermediate 256)."""
    from conftest import hf_checkpoint

    return hf_checkpoint(tmp_path_factory.mktemp("source"), hidden_size=128, head_dim=32, intermediate_size=256)


# --- read back exactly ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [32, 64])
def test_packed_weights_read_back_exactly(source, tmp_path, make_engine, fmt, group):
    packed, _, known = write_checkpoint(source, tmp_path, fmt, group)
    weights = make_engine(packed).weights
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        want = {"qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"], "o": [p + "self_attn.o_proj.weight"],
                "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "down": [p + "mlp.down_proj.weight"]}
        for field, names in want.items():
            w = getattr(layer, field)
            assert isinstance(w, QuantWeight) and w.bits == 4 and w.group == group, (field, w)
            assert torch.equal(w.dequantize(), torch.cat([known[n] for n in names])), (fmt, field)
    assert isinstance(weights.lm_head, torch.Tensor)  # tied, unquantized: the embedding table as it was
    name = fmt.removesuffix("-asymmetric").removesuffix("_v2")
    assert weights.format == f"{name} (4-bit, group {group}), float32"


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_model_generates_the_dequantized_models_tokens(source, tmp_path, make_engine, fmt):
    packed, dense, _ = write_checkpoint(source, tmp_path, fmt, group=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 17, 42, 99], [1, 5, 6, 7, 8, 9, 10, 11, 12]]
    got = [s.output_token_ids for s in make_engine(packed).engine.run_to_completion(prompts, params)]
    want = [s.output_token_ids for s in make_engine(dense).engine.run_to_completion(prompts, params)]
    assert got == want
    assert len(set(got[0])) > 3  # not a degenerate repetition that any weights would give


def test_a_float_layer_beside_packed_ones_is_fused_in_float(source, tmp_path, make_engine):
    """A layer the quantizer left in float (an ignore list) makes its fused matrix float: the packed
    parts dequantized, exactly."""
    packed, _, known = write_checkpoint(source, tmp_path, "gptq", 32)
    tensors = load_file(packed / "model.safetensors")
    name = "model.layers.0.self_attn.v_proj."
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[name + suffix]
    tensors[name + "weight"] = known[name + "weight"]
    save_file(tensors, packed / "model.safetensors")
    weights = make_engine(packed).weights
    qkv = weights.layers[0].qkv
    assert isinstance(qkv, torch.Tensor)
    assert torch.equal(qkv, torch.cat([known[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert isinstance(weights.layers[1].qkv, QuantWeight)


# --- refusals ------------------------------------------------------------------------------------
def with_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= changes
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refusal(make_engine, folder, **opts) -> str:
    with pytest.raises((RunError, UsageError)) as e:
        make_engine(folder, **opts)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_awq_of_8_bits_is_refused_in_one_line(source, tmp_path):
    packed, _, _ = write_checkpoint(source, tmp_path, "awq")
    with_config(packed, bits=8)
    code, _, err = invoke("bench", "--model", str(packed), "--device", "cpu", "--num-prompts", "1")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "awq weights of 8 bits are not supported" in err


def test_gptq_with_act_order_is_refused(source, tmp_path, make_engine):
    packed, _, _ = write_checkpoint(source, tmp_path, "gptq")
    tensors = load_file(packed / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]
    save_file(tensors, packed / "model.safetensors")
    with_config(packed, desc_act=True)
    assert "act-order" in refusal(make_engine, packed)


@pytest.mark.parametrize("changes, says", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"zero_point": False}, "zero_point false"),
])
def test_other_schemes_are_refused(source, tmp_path, make_engine, changes, says):
    packed, _, _ = write_checkpoint(source, tmp_path, "awq")
    assert says in refusal(make_engine, with_config(packed, **changes))


def test_compressed_tensors_other_formats_are_refused(source, tmp_path, make_engine):
    packed, _, _ = write_checkpoint(source, tmp_path, "compressed-tensors")
    assert "format ['int-quantized']" in refusal(make_engine, with_config(packed, format="int-quantized"))
    with_config(packed, format="pack-quantized")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (packed / "config.json").write_text(json.dumps(config))
    assert "4-bit integer weights" in refusal(make_engine, packed)


def test_a_packed_tensor_of_the_wrong_shape_is_refused_before_reading(source, tmp_path, make_engine):
    packed, _, _ = write_checkpoint(source, tmp_path, "awq")
    tensors = load_file(packed / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.qweight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, packed / "model.safetensors")
    text = refusal(make_engine, packed)
    assert name in text and "the awq packing of a [256, 128] weight is I32 [128, 32]" in text


def test_quantization_of_a_packed_checkpoint_is_refused(source, tmp_path, make_engine):
    packed, _, _ = write_checkpoint(source, tmp_path, "gptq")
    assert "4-bit already" in refusal(make_engine, packed, quantization="int8")


def test_an_untied_lm_head_packed_too_is_read_packed(tmp_path, make_engine):
    """compressed-tensors without lm_head in its ignore list packs the LM head as well."""
    from conftest import hf_checkpoint

    source = hf_checkpoint(tmp_path / "untied", hidden_size=128, head_dim=32, intermediate_size=256,
                           tie_word_embeddings=False, vocab_size=224)
    packed, _, known = write_checkpoint(source, tmp_path, "compressed-tensors-asymmetric", 64)
    tensors = load_file(packed / "model.safetensors")
    q, zeros, scales, w = known_weight(tensors.pop("lm_head.weight"), 64)
    tensors |= packed_tensors("compressed-tensors-asymmetric", "lm_head.", q, zeros, scales)
    save_file(tensors, packed / "model.safetensors")
    weights = make_engine(packed).weights
    assert isinstance(weights.lm_head, QuantWeight) and torch.equal(weights.lm_head.dequantize(), w)


def test_bench_quality_leaves_out_the_weight_variants_of_a_packed_checkpoint(source, tmp_path):
    """A 4-bit checkpoint refuses `quantization` (its weights are 4-bit already): bench --quality
    knows it, and measures its KV cache's variants alone instead of failing at its fp8 weights."""
    from pagedcli.bench.quality import compressed_as
    from pagedcli.model.source import resolve_model

    packed, dense, _ = write_checkpoint(source, tmp_path, "awq")
    assert compressed_as(resolve_model(str(packed))) == "awq 4-bit"
    assert compressed_as(resolve_model(str(dense))) is None  # (tests/test_gguf.py runs bench --quality itself)
