"""Tensor parallelism over ``torch.distributed``: the rank's view of a model transformers sharded with ``tp_plan``
(its local KV heads, its process group), what the ranks agree on before the first step, the one broadcast of a
step's inputs from the rank that schedules (the leader, which takes the requests), and the loop the other ranks follow
it with."""

from hfaccel.distributed.agreement import agree_on_static_steps, agreed_budget
from hfaccel.distributed.launch import RankFailed, launched, supervise
from hfaccel.distributed.model import TensorParallel, check_sharding, shards_beyond_language_model, tensor_parallel
from hfaccel.distributed.role import TPRole
from hfaccel.distributed.steps import LeaderRunner, StepChannel, TensorParallelError, follow, tp_runner

__all__ = [
    "LeaderRunner",
    "RankFailed",
    "StepChannel",
    "TPRole",
    "TensorParallel",
    "TensorParallelError",
    "agree_on_static_steps",
    "agreed_budget",
    "check_sharding",
    "follow",
    "launched",
    "shards_beyond_language_model",
    "supervise",
    "tensor_parallel",
    "tp_runner",
]
