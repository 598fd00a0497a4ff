"""The model: where it comes from (source.py), its config, weights, tokenizer and network, and the
loader that puts them together with an engine."""
