"""The engine: requests in, tokens out, one step at a time (engine.py), through the scheduler, the
paged KV cache's host side, the model runner and the sampler; assembled from options in build.py."""
