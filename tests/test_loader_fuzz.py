"""Random corruptions of a real model folder (its JSON values changed, deleted or replaced, its
safetensors headers and data truncated or bit-flipped): each load either runs a short greedy
generation to the end or stops with one PagedCliError of one line, never any other exception."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import hf_checkpoint

DEMO = Path(__file__).resolve().parents[1] / "pagedcli" / "data" / "demo"
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A tiny transformers checkpoint with the demo model's tokenizer (2048 tokens), a chat
    template and sampling settings; once in one file, once in two shards and an index."""
    single = hf_checkpoint(tmp_path_factory.mktemp("fuzz") / "single", vocab_size=2048, bos_token_id=0, eos_token_id=1)
    shutil.copy(DEMO / "tokenizer.json", single)
    config = json.loads((DEMO / "tokenizer_config.json").read_text()) | {"chat_template": TEMPLATE}
    (single / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(DEMO / "generation_config.json", single)
    sharded = single.parent / "sharded"
    shutil.copytree(single, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for file, part in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2:])):
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"single": single, "sharded": sharded}


JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors.index.json")
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures", "model_type",
        "hidden_act", "attention_bias", "do_sample", "temperature", "top_k", "top_p", "bos_token", "eos_token",
        "add_bos_token", "chat_template", "weight_map")
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 9), st.sampled_from([0, -1, 2**31, 2**63, 10**9, 64, 2048]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["false", "true", "llama3", "linear", "../x.safetensors", "/etc/passwd", "{{ 1/0 }}", "{%"]),
)
VALUES = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "original_max_position_embeddings",
                                     "low_freq_factor", "high_freq_factor", "name", "template", "content",
                                     "model.norm.weight"]), SCALARS, max_size=4),
)

json_edit = st.tuples(st.just("json"), st.sampled_from(JSON_FILES), st.sampled_from(KEYS),
                      st.one_of(st.just("delete"), VALUES))
nested_edit = st.tuples(st.just("rope"), st.sampled_from(["factor", "rope_type", "original_max_position_embeddings",
                                                          "low_freq_factor", "high_freq_factor", "rope_theta"]),
                        VALUES)
whole_file = st.tuples(st.just("file"), st.sampled_from(JSON_FILES + ("tokenizer.json",) + SHARDS),
                       st.sampled_from(["[1, 2]", "7", "{ not json", "\udcff", "folder", "delete", "bad-utf8"]))
tensor_edit = st.tuples(st.just("tensors"), st.sampled_from(("model.safetensors",) + SHARDS),
                        st.sampled_from(["truncate", "flip", "header-length"]),
                        st.floats(0, 1), st.integers(0, 7))
EDITS = st.lists(st.one_of(json_edit, nested_edit, whole_file, tensor_edit), min_size=1, max_size=3)


def apply(folder: Path, edit) -> None:
    kind = edit[0]
    if kind == "json":
        _, name, key, value = edit
        path = folder / name
        if not path.is_file():
            return
        try:
            d = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            return  # an earlier edit broke it already
        if not isinstance(d, dict):
            return
        if value == "delete":
            d.pop(key, None)
        else:
            d[key] = value
        path.write_text(json.dumps(d))
    elif kind == "rope":
        _, key, value = edit
        path = folder / "config.json"
        try:
            d = json.loads(path.read_text())
            d.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0})[key] = value
        except (ValueError, UnicodeDecodeError, TypeError, AttributeError, OSError):
            return
        path.write_text(json.dumps(d))
    elif kind == "file":
        _, name, what = edit
        path = folder / name
        if path.is_dir():
            return
        if what == "delete" or what == "folder":
            path.unlink(missing_ok=True)
            if what == "folder":
                path.mkdir()
        elif what == "bad-utf8":
            path.write_bytes(b'{"a": "\xff\xfe"}')
        else:
            path.write_text(what, errors="surrogateescape")
    else:
        _, name, how, where, bit = edit
        path = folder / name
        if not path.is_file():
            return
        data = bytearray(path.read_bytes())
        if len(data) < 8:
            return
        header_end = 8 + min(struct.unpack("<Q", bytes(data[:8]))[0], len(data) - 8)
        if how == "truncate":
            data = data[: int(where * len(data))]
        elif how == "flip":  # half the flips in the header, half in the data
            region = (8, header_end) if bit % 2 else (header_end, len(data))
            if region[1] > region[0]:
                data[region[0] + int(where * (region[1] - region[0] - 1))] ^= 1 << bit
        else:
            data[:8] = struct.pack("<Q", int(where * 2**64) % 2**64)
        path.write_bytes(bytes(data))


def load_and_generate(folder: Path) -> None:
    from pagedcli.commands.generate import add_requests, sampling_defaults
    from pagedcli.engine.build import load
    from pagedcli.core.options import EngineOptions
    from pagedcli.core.options import SamplingParams

    loaded = load(EngineOptions(model=str(folder), device="cpu", num_blocks=64, batch=2))
    greedy = SamplingParams(max_tokens=4, seed=0)
    sampling_defaults(greedy, loaded.source.generation_config, set())  # its checks; the run stays greedy
    engine, tok = loaded.engine, loaded.tokenizer
    if tok is None:
        seqs = [engine.add_request([0, 5, 9], greedy)]
    else:
        seqs = add_requests(engine, tok, ["ROMEO:", "to be"], greedy, chat=tok.has_chat_template)
    while engine.has_unfinished:
        engine.step()
    vocab = loaded.source.config.vocab_size
    for s in seqs:
        assert s.is_finished
        assert s.error or (s.output_token_ids and all(0 <= t < vocab for t in s.output_token_ids))
        if tok is not None:
            tok.decode(s.output_token_ids)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(base=st.sampled_from(["single", "sharded"]), edits=EDITS)
def test_a_corrupted_model_folder_runs_or_fails_in_one_line(bases, base, edits):
    from pagedcli.core.errors import PagedCliError

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(bases[base], folder)
        for edit in edits:
            apply(folder, edit)
        try:
            load_and_generate(folder)
        except PagedCliError as e:
            text = str(e)
            assert text and "\n" not in text and len(text) < 600, text
