"""Llama (LlamaForCausalLM): the decoder every other family here is measured from. Biases on the
attention projections and on the MLP's when config.json's attention_bias / mlp_bias say so."""

from pagedcli.model.families.family import Family

FAMILY = Family(architecture="LlamaForCausalLM", model_type="llama")
