"""`bench --compare hf`: transformers' own `generate` on the same weights, prompts and batch, in the
same process, as the baseline the paged engine is measured against."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from pagedcli.core.errors import UsageError
from pagedcli.model.fp8 import Fp8Weight
from pagedcli.model.loader import Model
from pagedcli.model.quant import QuantWeight


def hf_model(model: Model):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        raise UsageError("--compare hf needs transformers", 'pip install transformers, or "pagedcli[test]"') from None
    if model.source.folder is not None:
        return LlamaForCausalLM.from_pretrained(model.source.folder, dtype=model.dtype).to(model.device).eval()
    # random weights: hand transformers views of ours, so both run the very same numbers
    cfg = LlamaConfig(**{k: v for k, v in model.source.config.raw.items() if not k.startswith("_")})
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf.load_state_dict(hf_state_dict(model), assign=True, strict=False)
    hf.model.rotary_emb = LlamaRotaryEmbedding(config=cfg).to(model.device)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf.eval()


def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """Our fused weights split back into transformers' names (views, no copies; fp8 and quantized
    weights (a GGUF file's), which transformers does not take as ours, dequantized into the model dtype)."""
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
