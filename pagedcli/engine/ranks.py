"""Tensor parallelism's processes: rank 0 is the command's own process (the engine, its scheduler and
block manager, the sampler); ranks 1 and up each hold a share of the model and of every block
(model/sharding.py) and follow rank 0's plans (engine/runner.py `follow`) until it ends.

`pagedcli ... --tensor-parallel-size N` starts its N - 1 workers itself on this host (as vLLM does),
through torch.distributed's TCP rendezvous on a free local port. Under `torchrun` (several hosts, the
standard way) every process runs the command: torchrun's RANK and WORLD_SIZE say which rank each is,
and ranks 1 and up become followers as soon as they have loaded their share.

A rank that dies ends the run: rank 0 watches its workers and, when one stops, says so in one line
(with the worker's own error, if it had one) and exits with code 1, killing the others; a worker whose
rank 0 is gone finds its next receive broken and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedcli.core.errors import PagedCliError, RunError, UsageError
from pagedcli.core.options import EngineOptions
from pagedcli.core.parallel import TensorParallelGroup

# A collective that waits longer than this for a rank fails (gloo's and NCCL's timeout): a hung
# rank ends the run, not the engine's every request forever. Loading a large model's shares comes
# first, so it is generous.
RANK_TIMEOUT = timedelta(minutes=10)
WATCH_INTERVAL_S = 0.2  # how often rank 0 looks at its workers
STOP_WAIT_S = 5.0  # at exit, how long a killed worker gets to be reaped
LOST_WAIT_S = 2.0  # after a failed collective, how long rank 0 looks for the worker that stopped
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
STOP_SIGNAL_WAIT_S = 2.0  # a worker ended by one of them: how long rank 0 gets to end on its own


@contextlib.contextmanager
def interrupts_held():
    """Rank 0's step under tensor parallelism: a Ctrl-C (SIGINT) during it is held until it ends,
    then delivered as it would have been. Interrupted between two collectives, rank 0 would leave
    the other ranks waiting in the step's next one, out of step for good (chat goes on after a
    Ctrl-C). Only the main thread takes signals; elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def join_ranks(opts: EngineOptions) -> TensorParallelGroup:
    """This process's place in the group of `opts.tensor_parallel_size` ranks: torchrun's, or rank 0
    with its workers started here."""
    world = opts.tensor_parallel_size
    if under_torchrun():
        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if size != world:
            raise UsageError(f"`tensor_parallel_size` {world}, but torchrun started {size} processes",
                             "give torchrun as many processes in all as the tensor-parallel size")
        group = connect(rank, world, "env://", int(os.environ.get("LOCAL_RANK", rank)), opts.device)
        atexit.register(group.say_stop)
        return group
    address = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")  # never fork: CUDA does not survive a fork
    workers = []
    for rank in range(1, world):
        errors, report = context.Pipe(duplex=False)
        process = context.Process(target=worker_main, name=f"pagedcli-rank-{rank}", daemon=True,
                                  args=(rank, world, address, opts, report))
        process.start()
        report.close()
        workers.append((rank, process, errors))
    watch = Watch(workers)
    atexit.register(watch.stop)
    threading.Thread(target=watch.run, name="pagedcli-ranks", daemon=True).start()
    group = connect(0, world, address, 0, opts.device)
    group.on_lost = watch.lost
    return group


def connect(rank: int, world: int, address: str, local_rank: int, device: str) -> TensorParallelGroup:
    """The process group: NCCL between GPUs (plans over a gloo group of their own), gloo on CPUs."""
    from pagedcli.engine.build import pick_device  # (here, not at the top: engine/build.py imports this module)

    cuda = pick_device(device).type == "cuda"
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"`tensor_parallel_size` {world}: rank {rank} has no GPU of its own "
                             f"({torch.cuda.device_count()} visible)", "use at most one rank a GPU")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=address, rank=rank, world_size=world,
                            timeout=RANK_TIMEOUT)
    tensors = dist.group.WORLD
    plans = dist.new_group(backend="gloo", timeout=RANK_TIMEOUT) if cuda else tensors
    return TensorParallelGroup(rank, world, tensors, plans)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follow(model, tp: TensorParallelGroup) -> None:
    """Ranks 1 and up: build what rank 0 builds and run the steps it plans, until it says stop."""
    from pagedcli.engine.build import build_runner

    runner = None
    while True:
        message = tp.receive()
        if message[0] == "build":
            runner = None  # (the one before lets go of its pool first)
            runner = build_runner(model, *message[1:])
        elif message[0] == "step":
            runner.follow(message[1])
        else:  # "stop"
            return


def worker_main(rank: int, world: int, address: str, opts: EngineOptions, report) -> None:
    """A worker process started by rank 0: join, load this rank's share, follow. A failure goes to
    rank 0 as one line (which it prints) and the exit code 1."""
    # a terminal's Ctrl-C is rank 0's to handle; SIGTERM ends a worker (what multiprocessing sends a
    # daemon child as its parent exits: the server's engine process, which ignores it, passes that on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        from pagedcli.engine.build import load_model

        tp = connect(rank, world, address, rank, opts.device)
        follow(load_model(opts, tp=tp), tp)
    except BaseException as e:  # noqa: BLE001 (every failure of a worker is rank 0's to tell)
        line = str(e) if isinstance(e, PagedCliError) else f"{type(e).__name__}: {e}".splitlines()[0]
        try:
            report.send(line)
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


class Watch:
    """Rank 0's watch over its workers: the first to stop while the run goes on ends it."""

    def __init__(self, workers: list):
        self.workers = workers  # (rank, process, the pipe its error comes through)
        self.stopping = threading.Event()
        self.failing = threading.Lock()  # one line, from whichever thread sees the loss first

    def run(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL_S):
            self.check()

    def check(self) -> None:
        for rank, process, errors in self.workers:
            code = process.exitcode
            if code is None or self.stopping.is_set():
                continue
            # a stop signal sent to the whole process group (a terminal's, a service manager's) reaches
            # the workers too: rank 0 is ending on it, and says so itself
            if -code in STOP_SIGNALS and self.stopping.wait(STOP_SIGNAL_WAIT_S):
                continue
            self.fail(rank, code, errors)

    def lost(self, error: Exception) -> None:
        """A collective of rank 0's failed: name the worker that stopped, if one did within a moment
        (else the caller's RunError says what the collective said)."""
        for _ in range(int(LOST_WAIT_S / WATCH_INTERVAL_S)):
            self.check()
            self.stopping.wait(WATCH_INTERVAL_S)

    def fail(self, rank: int, code: int, errors) -> None:
        self.failing.acquire()  # (never released: this ends the process)
        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        try:  # the worker's own error, where it sent one (a killed worker's pipe is only closed)
            if errors.poll():
                why = errors.recv()
        except (EOFError, OSError):
            pass
        error = RunError(f"tensor-parallel rank {rank} stopped: {why}",
                         "the run cannot go on without it; start it again")
        try:
            sys.stderr.write(f"error: {error}\n")
            sys.stderr.flush()
        finally:
            self.kill()
            os._exit(1)

    def stop(self) -> None:
        """At exit: the workers end with rank 0."""
        self.stopping.set()
        self.kill()

    def kill(self) -> None:
        for _, process, _ in self.workers:
            if process.exitcode is None:
                process.kill()
        for _, process, _ in self.workers:
            process.join(STOP_WAIT_S)
