"""``hfaccel bench engine --tensor-parallel-size N``: the engine over N tensor-parallel ranks, and the all-reduce
share of its decode step.

The model (a named config with random weights, or a folder) is saved once and loaded by every rank with
``tp_plan="auto"`` — transformers' own sharding, as ``hfaccel serve --tensor-parallel-size`` does — over NCCL (one
GPU per rank) or gloo (CPU). Rank 0 serves the workload through ``hfaccel.Engine`` (warmed up on it, then timed) and
times its decode step at the batch asked (as ``bench engine`` does, the other ranks running every step with it);
then every rank times the step's collectives alone: two all-reduces per layer (after ``o_proj`` and
``down_proj``) of ``[batch, hidden]`` in the model's dtype. Their sum over the step's time is the all-reduce share.
An estimate from the collectives' sizes, timed outside the step: inside a step they may overlap other work or
wait for a slower rank.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hfaccel.tools.bench.timing import sync, table
from hfaccel.tools.models import build_model

DECODE_CONTEXT = 128  # tokens per sequence in the timed decode step
REPS = 20  # timed repetitions of the collectives


@dataclass
class TPStepRow:
    model: str
    ranks: int
    backend: str  # "nccl" or "gloo"
    batch: int
    tokens_per_s: float  # serving the workload (output tokens)
    step_ms: float  # the engine's decode step at this batch (static step replay, or eager without graphs)
    all_reduce_ms: float  # two all-reduces per layer of [batch, hidden], timed alone
    all_reduce_share: float  # all_reduce_ms / step_ms


def run_tp(
    options, console, spec: str, work, max_num_seqs: int, max_num_batched_tokens: int, block_size: int = 16
) -> dict:
    """Save the model, run :func:`_rank` on ``options.tensor_parallel_size`` ranks, print and return the row."""
    from hfaccel.distributed import RankFailed, supervise

    size, batch = options.tensor_parallel_size, (options.batches or [min(64, max_num_seqs)])[0]
    need = sum(-(-(len(p) + n) // block_size) for p, n in zip(work.prompts, work.output_lens))
    settings = dict(
        max_num_seqs=max(max_num_seqs, batch),
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_blocks=max(need, batch * -(-(DECODE_CONTEXT + 8) // block_size)),
    )
    with tempfile.TemporaryDirectory(prefix="hfaccel-bench-tp-") as folder:
        build_model(spec, torch.device("cpu"), options.dtypes[0]).save_pretrained(folder)
        result = Path(folder) / "result.json"
        try:
            supervise(
                _rank,
                (
                    folder,
                    spec,
                    options.device.type,
                    str(options.dtypes[0]).removeprefix("torch."),
                    work,
                    batch,
                    settings,
                    str(result),
                ),
                size,
            )
        except RankFailed as error:
            raise SystemExit(f"hfaccel bench engine: {error}") from None
        row = json.loads(result.read_text())
    console.print(
        table(
            f"engine over {size} tensor-parallel ranks, {spec}: the all-reduce share of a decode step "
            "(the collectives timed alone)",
            [row],
        )
    )
    return {"engine_tp": [row]}


def _rank(folder: str, spec: str, device_type: str, dtype: str, work, batch: int, settings: dict, result: str) -> None:
    """One rank: the sharded model, the engine (rank 0 serves and times; the others follow), then the collectives."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    from hfaccel.distributed.launch import backend_for, init_ranks
    from hfaccel.engine import Engine
    from hfaccel.hf import accelerate
    from hfaccel.tools.bench.engine import _decode_step, _engine_run

    device = torch.device(device_type)
    init_ranks(backend_for(device))
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        distributed_config=DistributedConfig(tp_plan="auto"),
        dtype=getattr(torch, dtype),
        attn_implementation="sdpa",
    ).eval()
    engine = Engine(accelerate(model), **settings)
    device = engine.runner.device
    if engine.is_leader:
        try:
            _engine_run(engine, work, device, "warm-up")
            served = _engine_run(engine, work, device, "engine")
            step = _decode_step(engine, batch, DECODE_CONTEXT, device)
        finally:
            engine.shutdown()
    else:
        engine.follow()
    config = model.config.get_text_config(decoder=True)
    reduce_ms = all_reduce_ms(2 * config.num_hidden_layers, (batch, config.hidden_size), model.dtype, device)
    if dist.get_rank() == 0:
        row = TPStepRow(
            spec,
            dist.get_world_size(),
            backend_for(device),
            batch,
            served.tokens_per_s,
            step.step_ms,
            reduce_ms,
            reduce_ms / step.step_ms,
        )
        Path(result).write_text(json.dumps(asdict(row)))


def all_reduce_ms(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> float:
    """Milliseconds of ``count`` all-reduces of a ``shape`` tensor over the default group, back to back (median of
    :data:`REPS` timed runs after one warm-up; every rank calls it)."""
    import torch.distributed as dist

    tensor = torch.zeros(shape, dtype=dtype, device=device)  # sums of zeros: no overflow however many rounds
    samples = []
    for rep in range(REPS + 1):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor)
        sync(device)
        if rep:
            samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]
