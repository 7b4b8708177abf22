"""``hfaccel.Engine`` over a model transformers sharded with ``tp_plan="auto"`` on 2 ranks (gloo): rank 0 schedules
and samples, rank 1 follows its broadcast steps, and the outputs of 20 requests with mixed lengths and parameters
equal the single-process engine's."""

from __future__ import annotations

import pytest
import torch
import transformers

from hfaccel.engine import SamplingParams
from tests.helpers import mixed_prompts
from tests.tp.ranks import run_ranks

ENGINE = {"max_num_seqs": 6, "max_num_batched_tokens": 24, "num_blocks": 48, "block_size": 4}


def _params(budgets: list[int]) -> list[SamplingParams]:
    """Greedy, seeded sampling with each warper, penalties, n=2 (forks: copy-on-write blocks) and logprobs."""
    kinds = [
        lambda b: SamplingParams(max_tokens=b, temperature=0, ignore_eos=True),
        lambda b: SamplingParams(max_tokens=b, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        lambda b: SamplingParams(max_tokens=b, temperature=1.2, top_k=5, seed=11, ignore_eos=True),
        lambda b: SamplingParams(max_tokens=b, temperature=1.0, repetition_penalty=1.3, seed=3, n=2, ignore_eos=True),
        lambda b: SamplingParams(max_tokens=b, temperature=0, logprobs=2, presence_penalty=0.5, ignore_eos=True),
    ]
    return [kinds[i % len(kinds)](budget) for i, budget in enumerate(budgets)]


def _outputs(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in out.outputs] for out in outputs]


def _engine_rank(path: str, prompts: list[list[int]], budgets: list[int]) -> dict:
    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), **ENGINE)
    if not engine.is_leader:
        return {"forwards": engine.follow(), "kv_heads": engine.runner.pool.group_shapes[0][0]}
    try:
        outputs = engine.generate(prompts, _params(budgets))
        stats = engine.stats()
    finally:
        engine.shutdown()
    return {
        "outputs": _outputs(outputs),
        "stats": stats,
        "kv_heads": engine.runner.pool.group_shapes[0][0],
        "steps": engine.host_times.steps,
        "copies": engine.runner.pool.copies_made,
    }


def test_engine_under_tp_equals_single_process(saved_llama, tmp_path):
    import hfaccel

    prompts, budgets = mixed_prompts()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.float32)
    expected = _outputs(
        hfaccel.Engine(hfaccel.accelerate(single, attention="torch"), **ENGINE).generate(prompts, _params(budgets))
    )

    leader, follower = run_ranks(_engine_rank, str(saved_llama), prompts, budgets, workdir=tmp_path, timeout=120)

    assert leader["outputs"] == expected
    assert leader["stats"]["blocks_used"] == 0
    assert leader["kv_heads"] == follower["kv_heads"] == single.config.num_key_value_heads // 2
    assert follower["forwards"] >= leader["steps"] > 0  # every forward of the leader's ran on the follower
    assert leader["copies"] > 0  # n=2 forks made copy-on-write copies, which went to the follower with the steps


def _static_engine_rank(path: str, prompts: list[list[int]], budgets: list[int]) -> dict:
    """The engine with static decode steps (cuda_graphs=True: uncaptured on the CPU) on this rank; how many steps each
    rank ran through them."""
    import hfaccel
    from hfaccel.runner.graphs import DecodeGraphs

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=True, **ENGINE)
    static, run_packed = [], DecodeGraphs.run_packed
    engine.runner.graphs.run_packed = lambda *args: (
        static.append(args[0].shape[0]) or run_packed(engine.runner.graphs, *args)
    )
    result = {"static": static}
    if engine.is_leader:
        try:
            result["outputs"] = _outputs(engine.generate(prompts, _params(budgets)))
        finally:
            engine.shutdown()
    else:
        result["forwards"] = engine.follow()
    # a capture's verdict is every rank's: replayed by all or by none
    result["verdicts"] = [engine.runner.graphs.agree(True), engine.runner.graphs.agree(engine.is_leader)]
    return result


def _mismatched_rank(path: str) -> str:
    """Rank 0 asks for static decode steps, rank 1 not: both refuse to build the engine."""
    import torch.distributed as dist

    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    try:
        hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=dist.get_rank() == 0, **ENGINE)
    except ValueError as error:
        return str(error)
    return "built"


def test_engine_under_tp_runs_its_decode_steps_static_on_every_rank(saved_llama, tmp_path):
    """Decode steps go through the static (on CUDA: compiled and captured) steps on both ranks in lockstep — the
    same padded sizes in the same order — and the outputs still equal the single-process engine's."""
    import hfaccel

    prompts, budgets = mixed_prompts()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.float32)
    expected = _outputs(
        hfaccel.Engine(hfaccel.accelerate(single, attention="torch"), **ENGINE).generate(prompts, _params(budgets))
    )

    leader, follower = run_ranks(_static_engine_rank, str(saved_llama), prompts, budgets, workdir=tmp_path, timeout=120)

    assert leader["outputs"] == expected
    assert leader["static"] and leader["static"] == follower["static"]
    assert follower["forwards"] > len(follower["static"])  # prompt steps ran eagerly in between
    assert leader["verdicts"] == follower["verdicts"] == [True, False]


def test_ranks_that_disagree_on_static_steps_all_refuse_to_start(saved_llama, tmp_path):
    leader, follower = run_ranks(_mismatched_rank, str(saved_llama), workdir=tmp_path, timeout=60)
    assert leader == follower and "the ranks' decode steps differ" in leader


def _follower_failing_rank(path: str, prompts: list[list[int]], error: str) -> dict:
    """The engine on this rank; the follower's third forward raises ``error`` there alone (the leader goes into the
    forward's collectives): out of memory, or a CUDA error its device keeps (every later call fails). What each rank's
    engine ended with, and how long the follower took to end once its forward raised."""
    import datetime
    import time

    import hfaccel
    import hfaccel.device
    from hfaccel.distributed import TensorParallelError, steps

    steps.VERDICT_TIMEOUT = datetime.timedelta(seconds=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), **ENGINE)
    raised = []
    if not engine.is_leader:
        run_model, calls = engine.runner.run_model, []

        def failing(*args, **kwargs):
            calls.append(None)
            if len(calls) == 3:
                raised.append(time.monotonic())
                if error == "out of memory":
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated, on this rank alone)")
                hfaccel.device.device_works = lambda device: False
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (simulated)")
            return run_model(*args, **kwargs)

        engine.runner.run_model = failing
    try:
        if not engine.is_leader:
            return {"followed": engine.follow()}
        return {"outputs": engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))}
    except (TensorParallelError, hfaccel.device.DeviceLostError) as ended:
        waited = time.monotonic() - raised[0] if raised else None
        return {"error": f"{type(ended).__name__}: {ended}", "cause": repr(ended.__cause__), "waited": waited}
    finally:
        engine.shutdown()  # sends nothing once the ranks diverged


@pytest.mark.parametrize("error", ["out of memory", "device lost"])
def test_a_forward_failing_on_one_rank_alone_stops_every_rank(saved_llama, tmp_path, error):
    """A decode step that raises on the follower alone leaves the leader inside the forward's collectives. Out of
    memory there: the follower gets no word from the leader in time and stops with TensorParallelError. An error its
    device keeps: it stops at once with DeviceLostError (no word to wait for: nothing can run there any more). The
    leader stops too once its collective fails (its peer gone): its generate() raises instead of answering — no rank
    waits forever."""
    prompts, _ = mixed_prompts(4)
    leader, follower = run_ranks(_follower_failing_rank, str(saved_llama), prompts, error, workdir=tmp_path)
    if error == "out of memory":
        assert "TensorParallelError: TP rank 1: a forward raised" in follower["error"], follower
        assert "not every rank said it raised there too" in follower["error"], follower
        assert "OutOfMemoryError" in follower["cause"] and follower["waited"] >= 3, follower
    else:
        assert follower["error"].startswith("DeviceLostError:") and "illegal memory access" in follower["cause"]
        assert follower["waited"] < 3, follower
    assert leader["error"].startswith("TensorParallelError: TP rank 0: a forward raised"), leader
