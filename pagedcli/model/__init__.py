"""The model: where it comes from (source.py), its config, weights and their formats, tokenizer and
network, and the loader that reads them (the engine around them: engine/build.py)."""
