"""QuantWeight (model/quant.py) on the CPU: `quantization` int4 / int8 at load (round to nearest:
each value within half a scale), the CPU products (backends/cpu_quant.py) against the dequantized
reference for every form they choose, the forms prepared once, the names people see, and tokens
of the demo model quantized at load against the same weights dequantized into a float checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from helpers import invoke
from pagedcli.backends import cpu_quant
from pagedcli.backends.composed import linear
from pagedcli.bench.measure import decode_weight_bytes
from pagedcli.core.options import SamplingParams
from pagedcli.model.config import ModelConfig
from pagedcli.model.quant import QuantWeight, cat_quant, int4_group, pack_int4, quantize_int4, quantize_int8
from pagedcli.model.source import DEMO_FOLDER
from pagedcli.model.weights import random_weights

LINEARS = ("qkv", "o", "gate_up", "down")


def weight(out, width, scale=0.02, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=gen) * scale * torch.logspace(-1, 1, out)[:, None]  # rows of unlike sizes
    return w


# --- rounding at load ------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_rounds_each_value_within_half_a_scale(group):
    w = weight(48, 256)
    w[3, :group] = 0.25  # a constant group: exact
    q = quantize_int4(w, group)
    assert q.bits == 4 and q.group == group and q.q.shape == (48, 128) and q.scale.shape == (48, 256 // group)
    error = (w - q.dequantize()).abs().view(48, -1, group)
    assert (error <= q.scale[..., None] / 2 * (1 + 1e-5) + 1e-7).all()
    assert error[3, 0].max() == 0
    assert q.values().min() >= 0 and q.values().max() <= 15
    assert q.values().amax(-1).eq(15).all()  # every row's max and min are on the grid's ends (asymmetric)


def test_int8_rounds_each_value_within_half_a_scale_per_row():
    w = weight(40, 96)
    w[7] = 0.0
    q = quantize_int8(w)
    assert q.bits == 8 and q.group == 96 and q.offset is None and q.q.dtype == torch.int8
    assert ((w - q.dequantize()).abs() <= q.scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert q.scale[7].item() == 1.0 and q.dequantize()[7].eq(0).all()
    assert q.values().abs().amax(-1)[torch.arange(40) != 7].eq(127).all()


def test_int4_group_is_128_else_the_largest_that_divides():
    assert [int4_group(n) for n in (4096, 576, 1536, 96, 112)] == [128, 64, 128, 32, None]


def test_cat_stacks_outputs_and_fills_missing_offsets():
    a, b = quantize_int4(weight(16, 64), 32), quantize_int4(weight(32, 64, seed=1), 32)
    both = cat_quant([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    symmetric = QuantWeight(pack_int4(torch.full((16, 64), 8)), torch.ones(16, 2), None, 4, 32, "x")
    mixed = cat_quant([symmetric, a])
    assert torch.equal(mixed.dequantize(), torch.cat([symmetric.dequantize(), a.dequantize()]))


# --- the CPU products ------------------------------------------------------------------------------
def grouped_int8(out, width, group, offset: bool):
    """8-bit values in groups, as GGUF's Q8_0 (symmetric, group 32) and Q6_K (group 16, a minimum) store them."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (out, width), generator=gen, dtype=torch.int8)
    scale = torch.rand(out, width // group, generator=gen) * 1e-3
    return QuantWeight(q, scale, -scale * 3 if offset else None, 8, group, "Q8_0" if group == 32 else "Q6_K")


def int4_symmetric(out, width, group):
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (out, width), generator=gen)
    scale = torch.rand(out, width // group, generator=gen) * 1e-2
    return QuantWeight(pack_int4(q), scale, None, 4, group, "Q4_0")


CASES = {  # name: (weight, the form bfloat16 activations take)
    "int4 g32": (lambda: quantize_int4(weight(96, 256), 32), "int4pack"),
    "int4 g64": (lambda: quantize_int4(weight(960, 576), 64), "int4pack"),
    "int4 g128": (lambda: quantize_int4(weight(576, 1536), 128), "int4pack"),
    "int4 g256": (lambda: quantize_int4(weight(32, 512), 256), "int4pack"),
    "int4 no offset": (lambda: int4_symmetric(48, 128, 32), "int4pack"),
    "int4 outputs not of 16": (lambda: quantize_int4(weight(24, 64), 32), "float"),
    "int4 per channel": (lambda: quantize_int4(weight(32, 96), 96), "float"),
    "int8 per channel": (lambda: quantize_int8(weight(576, 1536)), "int8pack"),
    "int8 per channel, inputs not of 16": (lambda: quantize_int8(weight(64, 172)), "float"),
    "int8 group 32": (lambda: grouped_int8(64, 128, 32, False), "float"),
    "int8 group 16 offset": (lambda: grouped_int8(64, 128, 16, True), "float"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_cpu_product_matches_the_dequantized_reference(case, dtype, rows):
    make, half_form = CASES[case]
    w = make()
    assert cpu_quant.cpu_kind(w, dtype) == (half_form if dtype != torch.float32 else "float")
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    want = x.float() @ w.dequantize().T + bias.float()
    got = linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows, w.shape[0])
    scale = want.abs().max()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    else:  # 16-bit rounding of x, of the scales and of the output: a few of bfloat16's 2^-8 steps
        assert (got.float() - want).abs().max() <= 2e-2 * scale
        assert (got.float() - want).abs().mean() <= 4e-3 * scale


def test_a_form_is_prepared_once(monkeypatch):
    w = quantize_int4(weight(96, 256), 64)
    x = torch.randn(2, 256)
    linear(x, w)
    linear(x.bfloat16(), w)
    forms = dict(w.forms)
    assert set(forms) == {("float", torch.float32), ("int4pack", torch.bfloat16)}
    calls = []
    monkeypatch.setattr(QuantWeight, "dequantize", lambda *a, **k: calls.append(a) or torch.zeros(()))
    monkeypatch.setattr(cpu_quant, "int4pack", lambda *a: calls.append(a) or None)
    for _ in range(3):
        linear(x, w)
        linear(x.bfloat16(), w)
    assert calls == [] and all(w.forms[k] is forms[k] for k in forms)


# --- at load ---------------------------------------------------------------------------------------
def test_demo_quantized_at_load(make_engine):
    float_model = make_engine("demo").weights
    for quantization, fmt in (("int4", "int4 (group 128, asymmetric)"), ("int8", "int8 (per channel, symmetric)")):
        weights = make_engine("demo", quantization=quantization).weights
        assert weights.format == fmt
        for l, f in zip(weights.layers, float_model.layers):
            for name in LINEARS:
                w, ref = getattr(l, name), getattr(f, name)
                assert isinstance(w, QuantWeight) and w.source == quantization
                per_group = (ref - w.dequantize()).abs().view(w.shape[0], -1, w.group)
                assert (per_group <= w.scale[..., None] / 2 * (1 + 1e-5) + 1e-7).all()
        # the tied LM head is a quantized copy; the embedding table stays float for its lookups
        assert isinstance(weights.lm_head, QuantWeight) and torch.equal(weights.embed, float_model.embed)
        assert weights.nbytes < float_model.nbytes / (3 if quantization == "int4" else 2)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_demo_quantized_at_load_generates_the_dequantized_models_tokens(make_engine, tmp_path, quantization):
    """The demo model with `quantization` int4 / int8 generates exactly what a float32 checkpoint of
    the same weights dequantized generates (the CPU product of float32 rows is the dequantized matrix's)."""
    loaded = make_engine("demo", quantization=quantization)
    w = loaded.weights
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm}
    for i, l in enumerate(w.layers):
        p = f"model.layers.{i}."
        qkv, o, gate_up, down = (getattr(l, n).dequantize() for n in LINEARS)
        q, k, v = qkv.split([256, 128, 128])
        gate, up = gate_up.chunk(2)
        tensors |= {p + "input_layernorm.weight": l.input_norm, p + "post_attention_layernorm.weight": l.post_norm,
                    p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": o, p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": down}
    tensors["lm_head.weight"] = w.lm_head.dequantize()
    folder = tmp_path / "dequantized"
    shutil.copytree(DEMO_FOLDER, folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    prompts = [loaded.tokenizer.encode(p) for p in ("ROMEO:", "First Citizen:\nBefore we proceed")]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = [s.output_token_ids for s in loaded.engine.run_to_completion(prompts, params)]
    want = [s.output_token_ids for s in make_engine(folder).engine.run_to_completion(prompts, params)]
    assert got == want and len(set(got[0])) > 5


def test_random_weights_quantized():
    config = ModelConfig.from_dict(json.loads((DEMO_FOLDER / "config.json").read_text()))
    for quantization in ("int4", "int8"):
        weights = random_weights(config, torch.bfloat16, "cpu", quantization=quantization)
        assert all(isinstance(getattr(l, n), QuantWeight) for l in weights.layers for n in LINEARS)
        assert isinstance(weights.lm_head, QuantWeight) and weights.embed.dtype == torch.bfloat16


def test_int4_leaves_a_layer_without_a_group_in_float_and_says_so_once(tiny):
    """hf_checkpoint's tiny model: intermediate 112, which no int4 group divides: down stays float."""
    code, out, err = invoke("bench", "--model", str(tiny), "--device", "cpu", "--quantization", "int4",
                            "--num-prompts", "2", "--input-len", "8", "--output-len", "4")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "stay in" in line]
    assert notes == ["note: 2 of the model's 8 linear layers stay in float32: their inputs are not a multiple of 32 "
                     "(--quantization int4's groups)"]


def test_roofline_counts_the_compressed_bytes(make_engine):
    loaded = make_engine("demo", quantization="int4")
    w = loaded.weights
    linears = sum(getattr(l, n).nbytes for l in w.layers for n in LINEARS)
    values = sum(getattr(l, n).shape.numel() for l in w.layers for n in LINEARS) // 2
    scales = sum(getattr(l, n).scale.numel() * 8 for l in w.layers for n in LINEARS)  # a scale and an offset, float32
    assert linears == values + scales
    norms = sum(l.input_norm.numel() + l.post_norm.numel() for l in w.layers) * 4 + w.norm.numel() * 4
    # the embedding table is only looked up; its int4 copy, the LM head, is read whole
    assert decode_weight_bytes(loaded) == linears + w.lm_head.nbytes + norms


def test_bench_and_inspect_cache_name_the_format(make_engine):
    code, out, err = invoke("bench", "--model", "demo", "--device", "cpu", "--quantization", "int4", "--batch", "2",
                            "--input-len", "8", "--output-len", "4", "--cache-size", "4MiB", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["weights"] == "int4 (group 128, asymmetric)"
    assert r["weight_bytes_per_step"] == decode_weight_bytes(make_engine("demo", quantization="int4"))
    code, out, err = invoke("bench", "--model", "demo", "--device", "cpu", "--quantization", "int8", "--batch", "2",
                            "--input-len", "8", "--output-len", "4", "--cache-size", "4MiB")
    assert code == 0 and "float32, weights int8 (per channel, symmetric)" in out, err
    code, out, err = invoke("inspect-cache", "--model", "demo", "--device", "cpu", "--quantization", "int4",
                            "--max-tokens", "4", "ROMEO:")
    assert code == 0 and any(l.split() == ["weights", "int4", "(group", "128,", "asymmetric)"] for l in out.splitlines())
    code, out, err = invoke("inspect-cache", "--model", "demo", "--device", "cpu", "--max-tokens", "4", "--json", "ROMEO:")
    assert code == 0 and json.loads(out)["weights"] == "float32"
