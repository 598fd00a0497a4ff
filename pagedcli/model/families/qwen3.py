"""Qwen3 (Qwen3ForCausalLM): an RMSNorm over each head of q and of k before RoPE (weights
self_attn.q_norm and self_attn.k_norm, head_dim each); no biases unless attention_bias; head_dim
given apart from hidden_size / num_attention_heads."""

from pagedcli.model.families.family import Family, refuse_sliding_window

FAMILY = Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, check=refuse_sliding_window)
