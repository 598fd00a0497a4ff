"""One forward pass captured into a CUDA graph, and a graph a bucket captured on first use: what
both kinds of graph share (engine/runner.py DecodeGraphs, cuda_prefill_graphs.PrefillGraphs)."""

from __future__ import annotations

import gc

import torch


def capture_forward(model, batch, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A graph of `model`'s forward pass and greedy argmax over `batch`'s static tensors, its memory
    from `pool`: (graph, logits, greedy tokens), the last two its static outputs. The pass runs once
    on a side stream first, so that nothing (the allocator, cuBLAS's workspace, our scratch buffers)
    is set up for the first time inside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.forward(batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # no garbage collection while capturing: one that frees an earlier engine's graph (a bench's
    # previous batch size, a test's) destroys it inside the capture, which CUDA then refuses
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            logits, tokens = model.forward(batch)
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize()
    return graph, logits, tokens


class CapturedGraphs:
    """Graphs of the forward pass, one per bucket, captured on first use (`graph(n)`): what the
    decode and the prefill graphs share. A subclass sets `model`, `pool`, `buckets` and
    `captured` = {} (bucket -> (graph, its static batch, its logits, its greedy tokens); the batch
    lives as long as its graph, which reads its tensors' memory) and gives `padding_batch(n)`:
    bucket n's static batch with padding inputs staged, so that the capture writes nothing."""

    def graph(self, n: int):
        if n not in self.captured:
            batch = self.padding_batch(n)
            graph, logits, tokens = capture_forward(self.model, batch, self.pool)
            self.captured[n] = graph, batch, logits, tokens
        return self.captured[n]
