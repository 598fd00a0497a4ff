"""Tensor parallelism's communication: a group of ranks, each holding a share of every layer's heads
and columns (model/sharding.py), that sum their partial products and gather their shares of the
vocabulary through torch.distributed (gloo on CPUs, NCCL on GPUs).

Rank 0 runs the engine (scheduler, block manager, sampler); every step it broadcasts the step's plan
(core/batch.py StepPlan) to the other ranks, which run the same forward pass on their shares
(engine/ranks.py). Plans travel over a gloo group on the host even when the tensors travel over
NCCL, so that sending one never waits for the GPU.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pagedcli.core.errors import RunError

# How long a rank waits for rank 0's next plan: as long as an engine may idle (a server between
# requests, a chat between turns); the collectives of a step keep the group's own timeout.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankView:
    """What a rank holds of the pool, for the view and inspect-cache."""

    rank: int
    device: str
    kv_heads: tuple[int, int]  # the KV heads [first, last + 1) of every block this rank holds
    pool_address: int
    pool_bytes: int


class TensorParallelGroup:
    """`rank` of `world` ranks. `tensors`: the process group the activations' collectives run on;
    `plans`: a gloo group (the same one on CPUs) for the plans rank 0 broadcasts."""

    def __init__(self, rank: int, world: int, tensors, plans=None):
        self.rank, self.world = rank, world
        self.tensors = tensors
        self.plans = plans if plans is not None else tensors
        # called with the error when a collective fails (a rank died): rank 0's watch over its workers
        # names the rank and ends the run (engine/ranks.py); else the failure is a RunError here
        self.on_lost: Callable[[Exception], None] | None = None
        self.in_step = False  # rank 0: a step's plan went out and its collectives are not all done

    def say_stop(self) -> None:
        """Rank 0 at exit: the other ranks end too (not mid-step: they are in the step's collectives,
        and end when its connections close)."""
        if self.rank == 0 and not self.in_step:
            try:
                self.send(("stop",))
            except RunError:
                pass

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo's and NCCL's word for a peer gone: its connection reset
            if self.on_lost is not None:
                self.on_lost(e)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RunError(f"a tensor-parallel rank stopped answering ({first[:200]})",
                           "the run cannot go on without it; start it again") from None

    # --- the forward pass's collectives ---------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, in place (after the o and down projections' partial products)."""
        self._wait(self.tensors.allreduce([t]))
        return t

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's [rows, n] `t` side by side ([rows, world * n]), cut to `width` columns (a
        vocabulary that does not divide pads the last rank's share)."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(self.tensors.allgather([parts], [t.contiguous()]))
        return torch.cat(parts, dim=-1)[:, :width]

    def broadcast(self, t: torch.Tensor, group=None, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's `t` into every rank's (same shape and dtype), in place, over `group` (default:
        the tensors'); `timeout`: the group's own where None."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout is not None:
            options.timeout = timeout
        self._wait((group or self.tensors).broadcast([t], options))
        return t

    # --- the plans ----------------------------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: `message` (any picklable value) to every other rank's `receive`."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast_plan(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast_plan(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self):
        """Ranks 1 and up: the next message rank 0 sent."""
        size = self._broadcast_plan(torch.zeros(1, dtype=torch.int64))
        data = self._broadcast_plan(torch.empty(int(size.item()), dtype=torch.uint8))
        return pickle.loads(data.numpy().tobytes())

    def gather_objects(self, value) -> list:
        """Every rank's small picklable `value`, in rank order, on every rank (startup only)."""
        data = pickle.dumps(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._wait(self.plans.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]))
        width = int(max(s.item() for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        self._wait(self.plans.allgather([parts], [mine]))
        return [pickle.loads(p[:int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def _broadcast_plan(self, t: torch.Tensor) -> torch.Tensor:
        # the other ranks wait for rank 0's next step however long it idles
        return self.broadcast(t, self.plans, IDLE_TIMEOUT)


def vocab_share(vocab: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first, stop, width): the rows of the embedding and LM head that `rank` holds, and the width
    every rank's share is padded to (vLLM's VocabParallelEmbedding: equal shares, the last short)."""
    width = -(-vocab // world)
    first = min(rank * width, vocab)
    return first, min(first + width, vocab), width
