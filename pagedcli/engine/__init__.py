"""The engine: requests in, tokens out, one step at a time (engine.py), through the scheduler, the
paged KV cache, the model runner and the sampler."""
