"""`bench --compare hf`: transformers' own `generate` on the same weights, prompts and batch, in the
same process, as the baseline the paged engine is measured against."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.fp8 import Fp8Weight
from pagedcli.model.loader import Model
from pagedcli.model.quant import QuantWeight


def hf_model(model: Model):
    """transformers' class of the model's architecture (LlamaForCausalLM, Qwen2ForCausalLM, ...): a
    folder read by transformers itself; random weights and a GGUF file's handed over as ours."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        raise UsageError("--compare hf needs transformers", 'pip install transformers, or "pagedcli[test]"') from None
    if model.source.folder is not None:
        return AutoModelForCausalLM.from_pretrained(model.source.folder, dtype=model.dtype).to(model.device).eval()
    # random weights, a GGUF file's: hand transformers views of ours, so both run the very same numbers
    raw = {k: v for k, v in model.source.config.raw.items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(raw.pop("model_type", "llama"), **raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    state = hf_state_dict(model)
    missing = [k for k in hf.state_dict() if k not in state and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:  # a weight transformers' class has and ours does not name: it would run unset
        raise RunError(f"--compare hf: {model.source.name}'s {missing[0]} has no counterpart here",
                       "compare a model folder instead")
    hf.load_state_dict(state, assign=True, strict=False)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).to(model.device)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf.eval()


def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """Our fused weights split back into transformers' names (views, no copies; fp8 and quantized
    weights (a GGUF file's), which transformers does not take as ours, dequantized into the model
    dtype), the families' biases and head norms with them."""
    c, w = model.source.config, model.weights

    def dense(t):
        return t.dequantize(model.dtype) if isinstance(t, (Fp8Weight, QuantWeight)) else t

    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": dense(w.lm_head)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = dense(lw.qkv).split([c.q_dim, c.kv_dim, c.kv_dim])
        gate, up = dense(lw.gate_up).chunk(2)
        sd |= {p + "input_layernorm.weight": lw.input_norm, p + "post_attention_layernorm.weight": lw.post_norm,
               p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": dense(lw.o), p + "mlp.gate_proj.weight": gate,
               p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": dense(lw.down)}
        if lw.qkv_bias is not None:
            sd |= dict(zip((p + f"self_attn.{n}_proj.bias" for n in "qkv"), lw.qkv_bias.split([c.q_dim, c.kv_dim, c.kv_dim])))
        if lw.o_bias is not None:
            sd[p + "self_attn.o_proj.bias"] = lw.o_bias
        if lw.gate_up_bias is not None:
            sd |= dict(zip((p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"), lw.gate_up_bias.chunk(2)))
        if lw.down_bias is not None:
            sd[p + "mlp.down_proj.bias"] = lw.down_bias
        if lw.q_norm is not None:
            sd |= {p + "self_attn.q_norm.weight": lw.q_norm, p + "self_attn.k_norm.weight": lw.k_norm}
    return sd


@torch.inference_mode()
def hf_generate(hf, requests, batch: int, device: torch.device, ignore_eos: bool) -> dict:
    """Greedy `generate` over the requests, `batch` at a time (left-padded)."""

    def run(chunk):
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in chunk)
        hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, do_sample=False,
                    min_new_tokens=new if ignore_eos else 0, pad_token_id=0,
                    eos_token_id=None if ignore_eos else hf.generation_config.eos_token_id)

    run([replace(requests[0], max_tokens=2)])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        run(requests[i:i + batch])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = sum(r.max_tokens for r in requests)
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}
