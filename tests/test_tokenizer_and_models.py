"""Tokenizer, chat template, stop ids, config parsing and weight loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, hf_checkpoint
from pagedcli.model.config import ModelConfig
from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.source import resolve_model
from pagedcli.model.tokenizer import StreamDecoder, Tokenizer
from pagedcli.model.weights import load_weights


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer):
    return Tokenizer(llama3_tokenizer)


def test_llama3_chat_template_renders_like_transformers(llama3):
    assert llama3.encode("What is 2+2?", chat=True) == [
        128000, 128006, 882, 128007, 271, 3923, 374, 220, 17, 10, 17, 30, 128009, 128006, 78191, 128007, 271]
    assert [len(llama3.encode(p, chat=True)) for p in ["What is 2+2?", "Name a color.", "Say hello.",
                                                        "Capital of France?"]] == [17, 14, 13, 14]
    assert llama3.decode([791, 4320, 374, 220, 19]) == "The answer is 4"


def test_raw_prompt_gets_bos_from_the_post_processor(llama3, stories):
    assert llama3.encode("Hello")[0] == 128000
    assert Tokenizer(stories).encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_chat_template_matches_transformers_apply_chat_template(llama3_tokenizer, llama3):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(llama3_tokenizer)
    for prompt in ["  padded  ", "line one\nline two", "Größe? 日本"]:
        ref = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert llama3.encode(prompt, chat=True) == list(ref)


def test_stream_decoder_never_splits_characters(llama3):
    text = "naïve café 日本語 — ok 🙂"
    ids = llama3.encode(text)[1:]
    dec = StreamDecoder(llama3)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("folder", ["pagedcli/data/demo", "tests/assets/stories260K"], ids=["byte-level", "byte-fallback"])
def test_a_tokens_bytes_join_into_the_texts_bytes(folder):
    """OpenAI's logprobs `bytes`: each token's own bytes, the pieces of a character too (their text
    alone is U+FFFD), so that they join into the text's UTF-8: GPT-2's byte-level pieces (the demo
    model, Llama 3) and SentencePiece's `<0xF0>` byte fallback and its `▁` (stories260K, Llama 2)."""
    tok = Tokenizer(REPO / folder)
    text = "Hé 😀 ok\u2028"
    ids = tok.tok.encode(text, add_special_tokens=False).ids
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # (pieces of a character are here)
    joined = b"".join(tok.token_bytes(i) for i in ids)
    assert joined.removeprefix(b" ") == text.encode()  # (SentencePiece's own leading space)
    assert tok.token_bytes(tok.tok.token_to_id(tok.bos_token)) == tok.bos_token.encode()


def test_stop_ids_from_generation_config_list_or_int(tmp_path):
    folder = hf_checkpoint(tmp_path, eos_token_id=2)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5, 9]}))
    assert resolve_model(str(folder)).stop_ids == {2, 5, 9}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert resolve_model(str(folder)).stop_ids == {2, 7}


def test_config_reads_both_rope_formats():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = ModelConfig.from_dict(base | {"rope_theta": 500000.0, "rope_scaling": scaling})
    new = ModelConfig.from_dict(base | {"rope_parameters": scaling | {"rope_theta": 500000.0}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == scaling
    assert old.num_kv_heads == 2 and old.head_dim == 4


def test_unsupported_architecture_is_named():
    with pytest.raises(RunError, match="GemmaForCausalLM is not supported") as e:
        ModelConfig.from_dict({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    assert "MistralForCausalLM" in e.value.hint  # the supported ones are named


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    from transformers import LlamaForCausalLM

    single = hf_checkpoint(tmp_path / "single")
    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    config = ModelConfig.from_file(single / "config.json")
    a = load_weights(single, config, torch.float32, "cpu")
    b = load_weights(sharded, config, torch.float32, "cpu")
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv) and torch.equal(a.lm_head, b.lm_head)
    assert a.lm_head is a.embed  # tied: one tensor


def test_random_preset_has_the_real_llama_shapes(llama_1b_config):
    src = resolve_model("random:llama-3.2-1b")
    real = ModelConfig.from_file(llama_1b_config)
    assert src.config.num_parameters == real.num_parameters == 1_235_814_400
    assert src.random and src.folder is None


def test_a_missing_folder_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(UsageError):
        resolve_model("random:no-such-preset")


def test_wrong_tensor_shape_is_named(tmp_path):
    folder = hf_checkpoint(tmp_path / "a")
    other = hf_checkpoint(tmp_path / "b", intermediate_size=96)
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")
    config = ModelConfig.from_file(folder / "config.json")
    with pytest.raises(RunError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
        load_weights(folder, config, torch.float32, "cpu")


def test_a_hub_id_without_a_namespace_is_a_hub_id(tmp_path, monkeypatch, tiny):
    """`gpt2` is a folder when there is one of that name, else a Hub id (the cache first); offline
    and not cached, the message says that no folder has the name either."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from pagedcli.model import source

    asked = []
    monkeypatch.setattr(source, "_cached_snapshot", lambda repo: asked.append(repo) or (tiny if repo == "gpt2" else None))
    monkeypatch.chdir(tmp_path)
    src = resolve_model("gpt2")
    assert asked == ["gpt2"] and src.name == "gpt2" and src.folder == tiny

    def offline(*_args, **_kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RunError, match="`model` distilgpt2: no such folder here, not in the local Hugging Face cache"):
        resolve_model("distilgpt2")
    shutil.copytree(tiny, tmp_path / "gpt2")  # a folder of that name wins
    assert resolve_model("gpt2").folder == Path("gpt2") and asked == ["gpt2", "distilgpt2"]
    with pytest.raises(UsageError, match="no such folder"):
        resolve_model("not a/hub id")
