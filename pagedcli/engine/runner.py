"""ModelRunner: turns the scheduler's sequences into a StepBatch and runs the network.

On a GPU with our CUDA backend, decode steps replay CUDA graphs captured per batch-size bucket:
the step's inputs go to the graph's static tensors in one host-to-device copy (the tensors are views
of one staging buffer, so nothing inside the graph copies them), the graph replays every kernel of
the forward pass and the greedy argmax at once, and the logits and tokens of the real rows come out.
Prefill-kind steps of up to cuda_prefill_graphs.MAX_GRAPH_TOKENS tokens do the same per token
bucket, through graphs the backend makes (backends/cuda_prefill_graphs.py); larger ones run eagerly.
"""

from __future__ import annotations

import torch

from pagedcli.backends.graph_capture import CapturedGraphs
from pagedcli.core.batch import StepBatch, StepPlan
from pagedcli.core.parallel import RankView, TensorParallelGroup
from pagedcli.engine.cache import KVCache
from pagedcli.engine.ranks import interrupts_held
from pagedcli.engine.sequence import Sequence
from pagedcli.model.network import Llama


def graph_buckets(max_slots: int) -> list[int]:
    """Batch sizes a decode graph is captured for (nano-vllm's choice): 1, 2, 4, 8, then 16 apart."""
    small = [b for b in (1, 2, 4, 8) if b < max_slots]
    return small + list(range(16, max_slots, 16)) + [max_slots]


class ModelRunner:
    def __init__(self, model: Llama, cache: KVCache, use_graphs: bool = False, max_step_tokens: int = 0):
        """max_step_tokens: the most new tokens a prefill-kind step feeds (the scheduler's budget)."""
        self.model = model
        self.cache = cache
        self.device = cache.device
        # rank 0 of a tensor-parallel group sends each step's plan to the others (which `follow` it)
        self.tp: TensorParallelGroup | None = model.tp if model.tp is not None and model.tp.rank == 0 else None
        self.ranks: tuple[RankView, ...] = ()  # what each rank holds of the pool (engine/build.py)
        self.graphs = DecodeGraphs(model, cache) if use_graphs else None
        # rows of logits for prompt log-probabilities, of the last step: (sequence, first position, [n, vocab])
        self.prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = []
        # the backend's graphs for prefill-kind steps, where it has them (CUDA: cuda_prefill_graphs.py)
        self.prefill_graphs = model.backend.prefill_graphs(model, max_step_tokens) if use_graphs and max_step_tokens else None

    def capture_graphs(self) -> None:
        """Capture every bucket's graph now rather than on first use (benchmarks: keep capture
        out of the timed run). Not under tensor parallelism: a capture runs the forward pass, whose
        collectives the other ranks meet only in a step, so there every rank captures at first use."""
        if self.model.tp is not None:
            return
        for graphs in (self.graphs, self.prefill_graphs):
            for n in graphs.buckets if graphs is not None else ():
                graphs.graph(n)

    def execute(self, seqs: list[Sequence], is_prefill: bool, feed: torch.Tensor | None = None,
                num_new: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What sampling needs for the next token of each sequence that samples: its logits,
        [S, vocab] float32, and its greedy token, [S] int64 (a decode graph computes them with the
        logits; else the backend's argmax, a kernel of ours on a GPU), in the order of `seqs`.

        num_new (prefill only): the tokens each sequence feeds from `num_cached` on (default: all it
        has not cached: whole prompts). A sequence samples when they reach its end; one whose chunk
        stops short of its prompt's end does not, and has no row in the result. At decode every
        sequence feeds one token and samples (S = len(seqs)).

        feed (decode only): the tokens to feed, [len(seqs)] on the device, sampled by a step the
        host has not seen the end of (the engine's overlap); each sequence is then one token longer
        than its host copy says, and that token is the one fed.

        Under tensor parallelism the other ranks run the same step from its plan (`follow`)."""
        # Before the batch's copy to the device, which the stream starts only once everything
        # ahead of it is done: the split-KV decode kernel reads the block table before its
        # programmatic-launch wait (with fp8 weights), safe only behind such a copy (kernels/common.cuh).
        table = self.cache.sync_device_table()
        copies = self.cache.copy_pending_blocks()  # copy-on-write, before this step writes K/V
        self.prompt_logits = []
        plan = step_plan(seqs, is_prefill, feed is not None, num_new)
        if self.tp is None:
            logits, greedy = self.run(plan, feed)
        else:  # every rank runs the whole step: a Ctrl-C waits for its end (chat goes on after one)
            plan.table, plan.copies = table, copies
            with interrupts_held():
                self.tp.send(("step", plan))
                self.tp.in_step = True  # (until the step's collectives are done: a failed one leaves it set)
                logits, greedy = self.run(plan, feed)
                self.tp.in_step = False
        if plan.prompt_rows:
            num_new = [len(t) for t in plan.token_ids]
            return self._prompt_rows(seqs, num_new, plan.samples, plan.every_row, logits, greedy)
        return logits, greedy

    def follow(self, plan: StepPlan) -> None:
        """A step rank 0 planned, on another rank: its table changes and block copies, then its
        forward pass (whose collectives meet rank 0's; the logits are rank 0's to sample)."""
        if plan.table is not None:
            self.cache.store.write_table(*plan.table)
        if plan.copies is not None:
            self.cache.store.copy_blocks(*plan.copies)
        self.run(plan)

    def run(self, plan: StepPlan, feed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass of `plan`: through a captured graph where one serves it, else eagerly."""
        slots, token_ids, num_cached = plan.slots, plan.token_ids, plan.num_cached
        if plan.is_prefill:
            if plan.prompt_rows:  # eagerly: a graph's logits are a row a sequence
                batch = StepBatch.build(True, slots, token_ids, num_cached, self.device, plan.samples, plan.every_row)
                return self.model.forward(batch)
            if self.prefill_graphs is not None and self.prefill_graphs.fits(sum(map(len, token_ids))):
                return self.prefill_graphs.replay(slots, token_ids, num_cached, plan.samples)
            batch = StepBatch.build(True, slots, token_ids, num_cached, self.device, plan.samples)
            return self.model.forward(batch)
        if plan.fed and self.model.tp is not None:  # rank 0's tokens, device to device
            feed = self.model.tp.broadcast(feed if feed is not None else
                                           torch.empty(len(slots), dtype=torch.int64, device=self.device))
        if self.graphs is not None:
            return self.graphs.replay(slots, [t[0] for t in token_ids], num_cached, feed)
        batch = StepBatch.build(False, slots, token_ids, num_cached, self.device)
        if feed is not None:
            batch.token_ids.copy_(feed)
        return self.model.forward(batch)

    def _prompt_rows(self, seqs, num_new, samples, every_row, logits, greedy) -> tuple[torch.Tensor, torch.Tensor]:
        """Split a step's logits where some sequences have a row for each new token: those rows go
        to `prompt_logits` as (sequence, first position, rows); the sampling rows are returned."""
        keep, at = [], 0
        for seq, n, sample, all_rows in zip(seqs, num_new, samples, every_row):
            rows = n if all_rows else int(sample)
            if all_rows:
                self.prompt_logits.append((seq, seq.num_cached, logits[at:at + n]))
            if sample:
                keep.append(at + rows - 1)
            at += rows
        index = torch.tensor(keep, dtype=torch.long).to(logits.device)
        return logits[index], greedy[index]


def step_plan(seqs: list[Sequence], is_prefill: bool, fed: bool = False, num_new: list[int] | None = None) -> StepPlan:
    """The step's plan (ModelRunner.execute's arguments as plain values): at prefill each sequence's
    tokens from `num_cached` on (`num_new` of them; default all it has not cached), whether it
    samples, whether it wants a row of logits for every token; at decode its last token (a stand-in
    where `fed`: the tokens are on the device) at the position of the count of tokens cached (with
    `fed`, one more)."""
    slots = [s.slot for s in seqs]
    if is_prefill:
        num_new = num_new or [len(s) - s.num_cached for s in seqs]
        every_row = [s.params.prompt_logprobs is not None and s.num_cached < len(s.prompt_token_ids) - 1 for s in seqs]
        return StepPlan(True, slots, [s.tokens_between(s.num_cached, s.num_cached + n) for s, n in zip(seqs, num_new)],
                        [s.num_cached for s in seqs], [s.num_cached + n == len(s) for s, n in zip(seqs, num_new)],
                        every_row if any(every_row) else None)
    if fed:
        return StepPlan(False, slots, [[0]] * len(seqs), [len(s) for s in seqs], fed=True)
    return StepPlan(False, slots, [[s.last_token] for s in seqs], [len(s) - 1 for s in seqs])


class DecodeGraphs(CapturedGraphs):
    """One CUDA graph per batch-size bucket, captured on first use. Rows past the real batch are
    padding: position -1 (no K/V written) and context length 0 (attention does nothing)."""

    # the step's inputs, one after another in one buffer of the largest bucket's size: their dtypes
    # are StepBatch's, so each graph's batch tensors are views of it (nothing to convert or copy)
    INPUTS = (("token_ids", torch.int64), ("positions", torch.int64), ("slots", torch.int32),
              ("context_lens", torch.int32))

    def __init__(self, model: Llama, cache: KVCache):
        self.model, self.cache = model, cache
        self.buckets = graph_buckets(cache.max_slots)
        n = self.buckets[-1]
        nbytes = sum(n * dtype.itemsize for _, dtype in self.INPUTS)
        # Two pinned host buffers, used in turn: with the engine's overlap, a step is staged while
        # the copy of the one before may still wait in the stream for the GPU. Two are enough
        # because the engine queues at most one step ahead: before it stages a step it has waited
        # for the step that used the same buffer (two runs back), or for a later one (a prefill
        # follows a step ahead that was voided), so that copy out of the buffer is done.
        self.host = [torch.zeros(nbytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.host_np = [{name: t.numpy() for name, t in self._inputs(h).items()} for h in self.host]  # cheapest writes
        self.num_runs = 0
        self.staged = torch.zeros(nbytes, dtype=torch.uint8, device=cache.device)
        self.inputs = self._inputs(self.staged)  # name -> [n] view of `staged`
        self.pool = torch.cuda.graph_pool_handle()
        # bucket -> (graph, its static batch, its logits, its greedy tokens); the batch must live as
        # long as the graph: the graph reads its tensors' memory, which the allocator would
        # otherwise hand out again
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, StepBatch, torch.Tensor, torch.Tensor]] = {}

    def _inputs(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The INPUTS as typed views of a byte buffer, in order."""
        n, views, at = self.buckets[-1], {}, 0
        for name, dtype in self.INPUTS:
            views[name] = buffer[at:at + n * dtype.itemsize].view(dtype)
            at += n * dtype.itemsize
        return views

    def _batch(self, n: int) -> StepBatch:
        """The static StepBatch of bucket n: its inputs are the first n entries of the staged ones."""
        rows = torch.arange(n, device=self.cache.device)
        return StepBatch(
            is_prefill=False,
            **{name: view[:n] for name, view in self.inputs.items()},
            token_seq=rows,
            last_index=rows.clone(),
            num_new=[1] * n,
            context_lens_host=[1] * n,
        )

    def padding_batch(self, n: int) -> StepBatch:
        self.inputs["positions"][:n] = -1  # padding rows only: nothing is written to the pool
        self.inputs["context_lens"][:n] = 0
        return self._batch(n)

    def replay(self, slots: list[int], tokens: list[int], num_cached: list[int],
            feed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket's graph for these rows: their logits and greedy tokens."""
        b = len(slots)
        n = next(size for size in self.buckets if size >= b)
        graph, _, logits, greedy = self.graph(n)
        turn = self.num_runs % 2
        self.num_runs += 1
        h = self.host_np[turn]
        h["token_ids"][:b] = tokens
        h["positions"][:b] = num_cached  # the new token's position = tokens already cached
        h["slots"][:b] = slots
        h["context_lens"][:b] = h["positions"][:b] + 1
        h["token_ids"][b:n], h["positions"][b:n], h["slots"][b:n], h["context_lens"][b:n] = 0, -1, 0, 0
        self.staged.copy_(self.host[turn], non_blocking=True)  # whole buffer: contiguous pinned memory, truly async
        if feed is not None:
            self.inputs["token_ids"][:b].copy_(feed)  # device to device: the tokens never visit the host
        graph.replay()
        return logits[:b], greedy[:b]
