"""What the sweep modules share: time each candidate configuration of a kernel call, keep the fastest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from hfaccel.tools.bench.timing import cold_graph_time_ms, graph_time_ms, time_ms

Config = TypeVar("Config")


def fastest(
    candidates: Iterable[Config], call: Callable[[Config], object], device: torch.device, console, graph: bool = False
) -> tuple[Config, float]:
    """The candidate whose ``call(candidate)`` runs fastest on ``device`` and its median microseconds (replayed in
    a CUDA graph when ``graph``: the GPU time of a captured step). A candidate that fails to compile or launch
    (e.g. out of shared memory on this GPU) is reported and skipped; ``ValueError`` if none runs."""
    timer = graph_time_ms if graph else time_ms
    return _fastest(candidates, lambda candidate: 1e3 * timer(lambda: call(candidate), device), console)


def fastest_cold(
    candidates: Iterable[Config],
    calls: Callable[[Config], list[Callable]],
    device: torch.device,
    console,
    reps: int,
    rep_ms: float,
) -> tuple[Config, float]:
    """The candidate whose calls (``calls(candidate)``: one per weight copy, the copies twice the L2's size) run
    fastest on ``device`` and its median microseconds per call (``timing.cold_graph_time_ms``: the GPU time of a
    captured decode step reading its weights from HBM; ``reps`` timed runs off CUDA). Off CUDA a candidate that
    fails raises (the interpreter runs every one); on a GPU it is reported and skipped."""
    return _fastest(
        candidates,
        lambda candidate: 1e3 * cold_graph_time_ms(calls(candidate), device, reps=reps, rep=rep_ms),
        console,
        skip_failures=device.type == "cuda",
    )


def _fastest(
    candidates: Iterable[Config], time_us: Callable[[Config], float], console, skip_failures: bool = True
) -> tuple[Config, float]:
    best: tuple[Config, float] | None = None
    for candidate in candidates:
        try:
            us = time_us(candidate)
        except Exception as error:  # noqa: BLE001 - a configuration this GPU / Triton rejects is skipped
            if not skip_failures:
                raise
            console.print(f"  skipped {candidate}: {type(error).__name__}: {str(error)[:200]}")
            continue
        if best is None or us < best[1]:
            best = (candidate, us)
    if best is None:
        raise ValueError("no candidate configuration ran on this device")
    return best
