"""What the TP ranks of one engine must agree on before the first step: the size of their KV pools (rank 0's block ids
index every rank's pool) and the static decode steps they run (the collectives inside them pair up)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, TypeVar

from hfaccel.distributed.model import TensorParallel
from hfaccel.runner.graphs import DecodeGraphs


class PoolPlan(Protocol):
    """A rank's own plan of its KV pool (the engine's ``KVBudget``: a frozen dataclass)."""

    num_blocks: int
    reason: str


Plan = TypeVar("Plan", bound=PoolPlan)


def agreed_budget(tp: TensorParallel, budget: Plan) -> Plan:
    """The pool every TP rank reserves: the smallest any rank planned (rank 0's block ids index every rank's pool)."""
    blocks = tp.min_over_ranks(budget.num_blocks)
    if blocks == budget.num_blocks:
        return budget
    return replace(budget, num_blocks=blocks, reason=f"{budget.reason}; the smallest of the {tp.size} TP ranks'")


def agree_on_static_steps(tp: TensorParallel, graphs: DecodeGraphs | None) -> None:
    """Under tensor parallelism every rank must run the same static steps (the collectives inside them pair up): a
    clear error on every rank when their settings differ; then each capture's verdict is every rank's."""
    mine = 0 if graphs is None else 1 + 2 * graphs.compiled + 4 * graphs.capture
    if tp.min_over_ranks(mine) != -tp.min_over_ranks(-mine):
        raise ValueError(
            "hfaccel.Engine under tensor parallelism: the ranks' decode steps differ (cuda_graphs, "
            "compile or the device); build the engine with the same arguments on every rank"
        )
    if graphs is not None:
        graphs.agree = lambda captured: tp.min_over_ranks(int(captured)) == 1
