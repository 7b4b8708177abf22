"""Run a function on N ranks over gloo (CPU), bounded in time: a rank that fails or a run past its timeout kills every
rank and fails the test (never a hang).

Each rank is a fresh process forked from a server process that has imported torch, transformers and hfaccel once
(``tests.tp.preload``; multiprocessing's "forkserver"), not a spawned one that imports them again: a rank starts in
well under a second rather than several. A rank gets the test process's environment as it is at the call."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from hfaccel.distributed.launch import end_rank, rank_environment, rendezvous_store

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.tp.preload"])


def run_ranks(target: Callable, *args, world_size: int = 2, timeout: float = 90.0, workdir: Path) -> list:
    """``target(*args)`` on ``world_size`` ranks (``torch.distributed`` initialized, gloo); each rank's return
    value, in rank order. ``target`` must be a module-level function (the ranks, forked from the server, unpickle it by
    name)."""
    store = rendezvous_store()
    environment = dict(os.environ)
    processes = [
        _CONTEXT.Process(
            target=_rank_main, args=(rank, world_size, store.port, environment, workdir, target, args), daemon=True
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in processes):
            failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if failed:
                raise AssertionError(f"rank {failed[0]} failed:\n{_error_of(workdir, failed[0])}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks ran past their {timeout:.0f} s timeout and were killed")
            time.sleep(0.05)
        failed = [rank for rank, p in enumerate(processes) if p.exitcode != 0]
        if failed:
            raise AssertionError(f"rank {failed[0]} failed:\n{_error_of(workdir, failed[0])}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return [torch.load(workdir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_main(
    rank: int, world_size: int, port: int, environment: dict, workdir: Path, target: Callable, args: tuple
) -> None:
    os.environ.clear()
    os.environ.update({**environment, **rank_environment(rank, world_size, port)})
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        result = target(*args)
        torch.save(result, workdir / f"rank{rank}.pt")
    except BaseException:
        (workdir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    end_rank()  # no interpreter finalization: it could abort a rank whose result is written


def _error_of(workdir: Path, rank: int) -> str:
    path = workdir / f"rank{rank}.err"
    return path.read_text() if path.exists() else "(no traceback: the process died)"
