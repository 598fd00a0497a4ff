"""ModelRunner: turns the scheduler's sequences into a StepBatch and runs the network.

On a GPU with our CUDA backend, decode steps replay CUDA graphs captured per batch-size bucket:
the step's inputs are copied into the graph's static tensors (one host-to-device copy), the graph
replays every kernel of the forward pass at once, and the logits of the real rows come out.
"""

from __future__ import annotations

import torch

from pagedcli.batch import StepBatch
from pagedcli.cache import KVCache
from pagedcli.llama import Llama
from pagedcli.sequence import Sequence


def graph_buckets(max_slots: int) -> list[int]:
    """Batch sizes a decode graph is captured for (nano-vllm's choice): 1, 2, 4, 8, then 16 apart."""
    small = [b for b in (1, 2, 4, 8) if b < max_slots]
    return small + list(range(16, max_slots, 16)) + [max_slots]


class ModelRunner:
    def __init__(self, model: Llama, cache: KVCache, use_graphs: bool = False):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.graphs = DecodeGraphs(model, cache) if use_graphs else None

    def capture_graphs(self) -> None:
        """Capture every bucket's graph now rather than on first use (benchmarks: keep capture
        out of the timed run)."""
        if self.graphs is not None:
            for n in self.graphs.buckets:
                self.graphs.graph(n)

    def run(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for each sequence's next token, [len(seqs), vocab] float32.

        feed (decode only): the tokens to feed, [len(seqs)] on the device, sampled by a step the
        host has not seen the end of (the engine's overlap); each sequence is then one token longer
        than its host copy says, and that token is the one fed."""
        self.cache.sync_device_table()
        self.cache.copy_pending_blocks()  # copy-on-write, before this step writes K/V
        slots = [s.slot for s in seqs]
        if is_prefill:
            batch = StepBatch.build(True, slots, [s.token_ids[s.num_cached:] for s in seqs],
                                    [s.num_cached for s in seqs], self.device)
        else:  # the new token's position is the count of tokens cached (with `feed`, one more)
            if feed is None:
                tokens, num_cached = [s.last_token for s in seqs], [len(s) - 1 for s in seqs]
            else:
                tokens, num_cached = [0] * len(seqs), [len(s) for s in seqs]  # stand-ins for `feed`
            if self.graphs is not None:
                return self.graphs.run(slots, tokens, num_cached, feed)
            batch = StepBatch.build(False, slots, [[t] for t in tokens], num_cached, self.device)
            if feed is not None:
                batch.token_ids.copy_(feed)
        self.model.backend.prepare(batch)
        return self.model.forward(batch)


class DecodeGraphs:
    """One CUDA graph per batch-size bucket, captured on first use. Rows past the real batch are
    padding: position -1 (no K/V written) and context length 0 (attention does nothing)."""

    def __init__(self, model: Llama, cache: KVCache):
        self.model, self.cache = model, cache
        self.buckets = graph_buckets(cache.max_slots)
        n = self.buckets[-1]
        dev = cache.device
        # inputs, staged as one int64 tensor [4, n]: token, position, slot, context length. Two
        # pinned host buffers, used in turn: with the engine's overlap, a step is staged while the
        # copy of the one before may still wait in the stream for the GPU. Two are enough because
        # the engine queues at most one step ahead: before it stages a step it has waited for the
        # step that used the same buffer (two runs back), or for a later one (a prefill follows a
        # step ahead that was voided), so that copy out of the buffer is done.
        self.host = [torch.zeros((4, n), dtype=torch.int64).pin_memory() for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]  # numpy writes into pinned memory cost least per step
        self.num_runs = 0
        self.staged = torch.zeros((4, n), dtype=torch.int64, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        # bucket -> (graph, its static batch, its logits); the batch must live as long as the graph:
        # the graph reads its tensors' memory, which the allocator would otherwise hand out again
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, StepBatch, torch.Tensor]] = {}

    def _batch(self, n: int) -> StepBatch:
        """The static StepBatch of bucket n; its tensors are filled from `staged` inside the graph."""
        dev = self.cache.device
        rows = torch.arange(n, device=dev)
        return StepBatch(
            is_prefill=False,
            token_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            token_seq=rows,
            slots=torch.zeros(n, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            last_index=rows.clone(),
            num_new=[1] * n,
            context_lens_host=[1] * n,
        )

    def _forward(self, batch: StepBatch, n: int) -> torch.Tensor:
        batch.token_ids.copy_(self.staged[0, :n])
        batch.positions.copy_(self.staged[1, :n])
        batch.slots.copy_(self.staged[2, :n])
        batch.context_lens.copy_(self.staged[3, :n])
        self.model.backend.prepare(batch)
        return self.model.forward(batch)

    def _capture(self, n: int):
        batch = self._batch(n)
        self.staged[1, :n] = -1  # capture with padding rows only: nothing is written to the pool
        self.staged[3, :n] = 0
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, lazy inits)
            self._forward(batch, n)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(batch, n)
        torch.cuda.synchronize()
        return graph, batch, logits

    def graph(self, n: int):
        if n not in self.captured:
            self.captured[n] = self._capture(n)
        return self.captured[n]

    def run(self, slots: list[int], tokens: list[int], num_cached: list[int],
            feed: torch.Tensor | None = None) -> torch.Tensor:
        b = len(slots)
        n = next(size for size in self.buckets if size >= b)
        graph, _, logits = self.graph(n)
        turn = self.num_runs % 2
        self.num_runs += 1
        h = self.host_np[turn]
        h[0, :b] = tokens
        h[1, :b] = num_cached  # the new token's position = tokens already cached
        h[2, :b] = slots
        h[3, :b] = h[1, :b] + 1
        h[0, b:n], h[1, b:n], h[2, b:n], h[3, b:n] = 0, -1, 0, 0
        self.staged.copy_(self.host[turn], non_blocking=True)  # whole buffer: contiguous pinned memory, truly async
        if feed is not None:
            self.staged[0, :b].copy_(feed)  # device to device: the tokens never visit the host
        graph.replay()
        return logits[:b]
