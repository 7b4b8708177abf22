"""Starting the tensor-parallel ranks of one program, and keeping them from outliving each other.

:func:`supervise` starts N ranks as processes of ``torch.multiprocessing`` (spawn) with the environment ``torchrun``
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so one rank function
serves both launchers. Like ``torchrun``'s agent, the supervising process hosts the ranks' rendezvous store
(:func:`rendezvous_store`) and then only watches its ranks' process sentinels:

- a rank that dies (an error, a signal) stops every other rank within seconds (SIGTERM, then SIGKILL after
  :data:`GRACE_S`) and the supervisor raises :class:`RankFailed` naming it, with its traceback;
- SIGTERM to the supervisor goes to rank 0, which stops the others itself (e.g. ``Engine.shutdown()``); the
  supervisor ignores SIGINT (Ctrl-C in a terminal reaches rank 0 too, and the other ranks ignore it);
- each rank exits when the supervisor dies (:func:`exit_with_parent`), even from the middle of a collective.

Under ``torchrun`` (:func:`launched`), ``torchrun`` is the supervisor: it stops every worker when one fails.

The ranks' process group gets a long timeout (:data:`IDLE_TIMEOUT`): a follower waits in a broadcast for the
leader's next step however long the leader stays idle; a dead peer ends that wait through the supervisor, not the
timeout (gloo also fails the wait at once when a peer's connection closes).
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

IDLE_TIMEOUT = datetime.timedelta(days=365)  # a serving rank may wait this long for the next step
GRACE_S = 2.0  # after a rank failed: seconds the others get to stop on SIGTERM before SIGKILL
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankFailed(RuntimeError):
    """A rank of a :func:`supervise` run failed (every other rank has been stopped)."""

    def __init__(self, rank: int, size: int, cause: str, details: str = ""):
        super().__init__(
            f"tensor-parallel rank {rank} of {size} failed: {cause}; every rank was stopped"
            + (f"\n{details}" if details else "")
        )
        self.rank, self.size = rank, size


def launched() -> int | None:
    """The world size when this process is a rank of a launcher (``torchrun``: its environment variables say so),
    else None."""
    if not all(name in os.environ for name in _LAUNCHER_VARIABLES):
        return None
    return int(os.environ["WORLD_SIZE"])


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for ranks on ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_ranks(backend: str) -> None:
    """Join the process group the launcher's environment describes (``env://``), with :data:`IDLE_TIMEOUT`: the
    group transformers' ``tp_plan="auto"`` then shards the model over."""
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=IDLE_TIMEOUT)


def supervise(target: Callable, args: tuple, size: int) -> None:
    """Run ``target(*args)`` on ``size`` ranks (spawned processes, the launcher's environment set, each exiting with
    the supervisor) until every rank returns; raises :class:`RankFailed` as soon as one fails. ``target`` must be
    importable by the spawned processes (a module-level function)."""
    if size < 1:
        raise ValueError(f"a tensor-parallel size must be at least 1; got {size}")
    store = rendezvous_store()
    context = torch.multiprocessing.start_processes(
        _rank_main, (size, store.port, target, args), nprocs=size, join=False, start_method="spawn"
    )
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _stop_leader(context))
    previous_interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0 itself
    try:
        while True:
            try:
                if context.join(timeout=0.5, grace_period=GRACE_S):
                    return
            except ProcessException as error:
                raise _failure(error, size) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)
        for process in context.processes:  # e.g. the supervisor was interrupted: no rank outlives it
            if process.is_alive():
                process.kill()


def exit_with_parent() -> None:
    """End this process (exit status 1) as soon as the process that spawned it exits — a daemon thread watching its
    sentinel, so that a rank waiting in a collective never outlives its supervisor. A no-op in a process that
    ``multiprocessing`` did not start."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        print(
            f"hfaccel: the supervising process {parent.pid} exited; rank process {os.getpid()} stops",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="hfaccel-exit-with-parent", daemon=True).start()


def rendezvous_store() -> dist.TCPStore:
    """A ``TCPStore`` server in this process on a loopback port the system picks, for ranks started with
    :func:`rank_environment` (they all connect to it as clients). The port is bound as it is chosen: a port probed
    free and handed to rank 0 to bind can be taken in between, e.g. by another group's gloo connection."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def rank_environment(index: int, size: int, port: int) -> dict[str, str]:
    """The environment of rank ``index`` of ``size`` (``torchrun``'s variables) whose rendezvous store is the
    supervisor's :func:`rendezvous_store` on ``port``."""
    return dict(
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is served by the supervisor, not by rank 0
    )


def _rank_main(index: int, size: int, port: int, target: Callable, args: tuple) -> None:
    os.environ.update(rank_environment(index, size, port))
    exit_with_parent()
    if index > 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops the others
    target(*args)
    end_rank()


def end_rank() -> NoReturn:
    """End this rank's process, its work done (exit status 0): its output flushed, then ``os._exit`` — no
    interpreter finalization, no ``atexit`` handlers. A process group's native threads outlive the Python calls that
    used them (gloo's workers drop a collective's tensors after its waiter has returned; the group lives as long as
    the model's device mesh holds it), and a native thread that asks for the GIL while the interpreter finalizes is
    ended mid-unwind: SIGABRT, "terminate called without an active exception", after every result was written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop_leader(context) -> None:
    leader = context.processes[0]
    if leader.is_alive():
        os.kill(leader.pid, signal.SIGTERM)


def _failure(error: ProcessException, size: int) -> RankFailed:
    if isinstance(error, ProcessExitedException):
        how = f"signal {error.signal_name}" if error.signal_name else f"exit code {error.exit_code}"
        return RankFailed(error.error_index, size, f"its process exited ({how})")
    return RankFailed(error.error_index, size, "it raised an error", str(error).split("error:\n", 1)[-1].strip())
