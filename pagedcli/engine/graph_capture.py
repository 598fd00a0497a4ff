"""One forward pass captured into a CUDA graph, as both kinds of graph are (runner.DecodeGraphs,
prefill_graphs.PrefillGraphs)."""

from __future__ import annotations

import torch


def capture_forward(model, batch, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A graph of `model`'s forward pass and greedy argmax over `batch`'s static tensors, its memory
    from `pool`: (graph, logits, greedy tokens), the last two its static outputs. The pass runs once
    on a side stream first, so that nothing (the allocator, cuBLAS's workspace, our scratch buffers)
    is set up for the first time inside the capture."""
    def forward():
        logits = model.forward(batch)
        return logits, model.greedy(logits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits, tokens = forward()
    torch.cuda.synchronize()
    return graph, logits, tokens
