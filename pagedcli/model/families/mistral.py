"""Mistral (MistralForCausalLM: Mistral-7B v0.1 to v0.3, Ministral, Mistral-Nemo): Llama's decoder,
with `sliding_window` N (v0.1: 4,096), where a token attends only to the last N positions, itself
included; null (v0.2, v0.3) is Llama."""

from pagedcli.model.families.family import Family

FAMILY = Family(architecture="MistralForCausalLM", model_type="mistral", sliding_window=True)
