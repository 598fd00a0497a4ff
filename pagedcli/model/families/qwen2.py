"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): biases on the q, k and v projections, none on o or the MLP;
tied input and output embeddings on the small ones (config.json says). `use_sliding_window` is off in
the released checkpoints; on, it is refused."""

from pagedcli.model.families.family import Family, refuse_sliding_window

FAMILY = Family(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True, o_bias=False,
                check=refuse_sliding_window)
