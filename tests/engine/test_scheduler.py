"""Scheduler edge cases driven directly (the engine's tests cover the common paths end to end)."""

from hfaccel.kv import BlockManager
from hfaccel.engine.outputs import CompletionOutput, RequestMetrics
from hfaccel.sampling import SamplingParams
from hfaccel.engine.scheduler import Request, Scheduler, Sequence, Status


def sequence(seq_id: int, tokens: list[int]) -> Sequence:
    request = Request(str(seq_id), None, list(tokens), SamplingParams(max_tokens=100), RequestMetrics(0.0), forked=True)
    seq = Sequence(seq_id, request, 0, list(tokens), CompletionOutput(0), None, None)
    request.seqs.append(seq)
    return seq


def test_a_sequence_the_whole_pool_cannot_hold_ends_instead_of_waiting_forever():
    """A sequence preempted (or grown) past what the whole pool holds can never be admitted again: it is handed
    back as out of blocks (the engine ends it, finish reason "length"), and the queue behind it moves on."""
    scheduler = Scheduler(BlockManager(6, 2), max_num_seqs=4, max_num_batched_tokens=64)
    too_long, fits = sequence(0, list(range(3, 16))), sequence(1, [5, 6, 7])  # 13 tokens need 7 blocks of 2
    scheduler.add(too_long)
    scheduler.add(fits)
    plan = scheduler.schedule()
    assert plan.out_of_blocks == [too_long] and [c.seq for c in plan.chunks] == [fits]
    scheduler.finish(too_long, "length")
    assert too_long.status is Status.FINISHED and list(scheduler.waiting) == []
    fits.num_computed = 3
    fits.token_ids += list(range(20, 30))  # grown to 13 tokens while running
    plan = scheduler.schedule()
    assert plan.out_of_blocks == [fits] and plan.chunks == [] and plan.preempted == []
