"""What the sweep modules share: time each candidate configuration of a kernel call, keep the fastest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from hfaccel.tools.bench.timing import graph_time_ms, time_ms

Config = TypeVar("Config")


def fastest(candidates: Iterable[Config], call: Callable[[Config], object], device: torch.device, console,
            graph: bool = False) -> tuple[Config, float]:
    """The candidate whose ``call(candidate)`` runs fastest on ``device`` and its median microseconds (replayed in
    a CUDA graph when ``graph``: the GPU time of a captured step). A candidate that fails to compile or launch
    (e.g. out of shared memory on this GPU) is reported and skipped; ``ValueError`` if none runs."""
    timer = graph_time_ms if graph else time_ms
    best: tuple[Config, float] | None = None
    for candidate in candidates:
        try:
            us = 1e3 * timer(lambda: call(candidate), device)
        except Exception as error:  # noqa: BLE001 - a configuration this GPU / Triton rejects is skipped
            console.print(f"  skipped {candidate}: {type(error).__name__}: {str(error)[:200]}")
            continue
        if best is None or us < best[1]:
            best = (candidate, us)
    if best is None:
        raise ValueError("no candidate configuration ran on this device")
    return best
