"""Scheduler edge cases driven directly (the engine's tests cover the common paths end to end)."""

import pytest

from hfaccel.engine.media import MediaInputs
from hfaccel.engine.outputs import CompletionOutput, RequestMetrics
from hfaccel.kv import BlockManager
from hfaccel.sampling import SamplingParams
from hfaccel.engine.scheduler import Request, Scheduler, Sequence, Status


def sequence(seq_id: int, tokens: list[int], media: MediaInputs | None = None) -> Sequence:
    request = Request(
        str(seq_id), None, list(tokens), SamplingParams(max_tokens=100), RequestMetrics(0.0), forked=True, media=media
    )
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


SYSTEM = list(range(100, 112))  # three blocks of 4
IMAGE = MediaInputs({}, "image digest", start=12, end=20)  # image tokens 12..19 after SYSTEM


def image_prompt(seq_id: int) -> Sequence:
    return sequence(seq_id, [*SYSTEM, *[7] * 8, 30, 31], IMAGE)  # 22 tokens


def chunks(plan) -> list[tuple[int, int, int]]:
    return [(chunk.seq.seq_id, chunk.start, chunk.length) for chunk in plan.chunks]


def running(scheduler: Scheduler, prompts: list[list[int]], first_id: int = 0) -> list[Sequence]:
    """Sequences admitted and their prompts computed: one sampled token each to decode."""
    seqs = [sequence(first_id + i, prompt) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    assert len(scheduler.schedule().chunks) == len(seqs)
    for seq in seqs:
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(9)
    return seqs


@pytest.mark.parametrize("system_prompt_cached", [True, False])
def test_a_prompt_with_images_beside_decodes_is_computed_in_one_chunk_from_its_prefix_hits(system_prompt_cached):
    """A prompt with images is computed in one chunk from its prefix-cache hits on: beside three decodes (21 of the
    budget of 24 left) its cached system prompt leaves 10 of its 22 tokens; with nothing cached all 22 go past the
    budget now (waiting for the decodes to end could wait forever) and the prompt behind it waits."""
    manager = BlockManager(32, 4)
    if system_prompt_cached:
        manager.add_sequence("system prompt", [*SYSTEM, 1])
        manager.free("system prompt")  # its three full blocks stay in the prefix cache
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=24)
    running(scheduler, [[1, 2, 3]] * 3)
    scheduler.add(image_prompt(3))
    scheduler.add(sequence(4, [5, 6]))
    decodes = [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    if system_prompt_cached:
        assert chunks(scheduler.schedule()) == [*decodes, (3, 12, 10), (4, 0, 2)]
    else:
        assert chunks(scheduler.schedule()) == [*decodes, (3, 0, 22)] and [seq.seq_id for seq in scheduler.waiting] == [
            4
        ]


@pytest.mark.parametrize("decodes", [0, 4])
def test_whole_prompts_wait_only_for_room_that_prompts_admitted_before_them_took(decodes):
    """Under ``whole_prompts`` (mixers that restart a chunk) a prompt waits for the next step where a prompt admitted
    before it took the budget it needs; beside running decodes alone it is admitted at once, past the budget by
    them, since the room they leave widens only when they end; one longer than the budget goes past it alone."""
    manager = BlockManager(64, 16, enable_prefix_caching=False, state_slots=8)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16, whole_prompts=True)
    running(scheduler, [[5 + i, 6] for i in range(decodes)])
    scheduler.add(sequence(10, list(range(3, 11))))  # 8 tokens
    scheduler.add(sequence(11, list(range(3, 15))))  # 12: past what the first leaves, within what the decodes leave
    scheduler.add(sequence(12, [7, 8]))
    steps = [(i, 2, 1) for i in range(decodes)]
    assert chunks(scheduler.schedule()) == [*steps, (10, 0, 8)]
    assert [seq.seq_id for seq in scheduler.waiting] == [11, 12]
    scheduler.running[-1].num_computed = 8
    scheduler.running[-1].token_ids.append(9)
    steps.append((10, 8, 1))
    behind = [(12, 0, 2)] if decodes == 0 else []  # five decodes leave 11: the 12 tokens go past the budget
    assert chunks(scheduler.schedule()) == [*steps, (11, 0, 12), *behind]
    manager = BlockManager(64, 16, enable_prefix_caching=False, state_slots=8)
    long = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16, whole_prompts=True)
    long.add(sequence(20, list(range(3, 40))))
    assert chunks(long.schedule()) == [(20, 0, 37)]


def test_a_prompt_with_images_waits_when_the_budget_left_is_short_of_what_its_hits_leave():
    """A prompt with images after a long text prefill (6 of the budget left): its 10 tokens after the cached system
    prompt wait for the next step, which computes them in one chunk."""
    manager = BlockManager(32, 4)
    manager.add_sequence("system prompt", [*SYSTEM, 1])
    manager.free("system prompt")
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=24)
    scheduler.add(sequence(0, list(range(40, 58))))
    scheduler.add(image_prompt(1))
    assert chunks(scheduler.schedule()) == [(0, 0, 18)]
    scheduler.running[0].num_computed = 18
    scheduler.running[0].token_ids.append(9)
    assert chunks(scheduler.schedule()) == [(0, 18, 1), (1, 12, 10)]


def test_a_prompt_with_images_admitted_in_a_step_that_did_not_count_is_computed_whole_in_the_next():
    """A step that raised (the engine's caller may go on stepping) leaves the prompts it admitted running with
    nothing computed: in a later step an image prompt's chunk is still all its tokens after its hits (its images'
    tokens are never split), past the budget when the sequences running before it take more of it than they did."""
    scheduler = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=24)
    (older,) = running(scheduler, [[1, 2, 3]])
    scheduler.add(image_prompt(1))
    assert chunks(scheduler.schedule()) == [(0, 3, 1), (1, 0, 22)]  # the step raises: nothing computed
    older.token_ids += [9] * 5  # (tokens appended while it runs: 6 to compute)
    assert chunks(scheduler.schedule()) == [(0, 3, 6), (1, 0, 22)]


TWO_IMAGES = [*range(100, 104), *[7] * 4, 50, 51, 52, 53, *[7] * 4, 60, 61]  # images on tokens 4..7 and 12..15


def two_images(first: str, second: str) -> MediaInputs:
    return MediaInputs({}, f"{first}, {second}", (first, second), start=4, end=16, spans=((4, 8), (12, 16)))


@pytest.mark.parametrize("between", [True, False])
def test_each_image_keys_the_blocks_from_its_first_token_on(between):
    """Once a prompt of images a and b is computed, one of images a and c takes the blocks up to c's first token and
    computes the rest in one chunk, and one of images d and b takes those before d's; where a prompt's images are
    computed together only (``hits_between_images=False``: a vision tower the ranks shard), both hits end before the
    first image."""
    manager = BlockManager(32, 4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, hits_between_images=between)
    computed = sequence(0, TWO_IMAGES, two_images("a", "b"))
    scheduler.add(computed)
    assert chunks(scheduler.schedule()) == [(0, 0, 18)]
    manager.mark_computed(0, len(TWO_IMAGES))
    scheduler.finish(computed, "stop")
    scheduler.add(sequence(1, TWO_IMAGES, two_images("a", "c")))
    scheduler.add(sequence(2, TWO_IMAGES, two_images("d", "b")))
    hit = 12 if between else 4
    assert chunks(scheduler.schedule()) == [(1, hit, 18 - hit), (2, 4, 14)]


def test_an_image_keys_its_blocks_by_its_length_too():
    """An image a processor encodes in fewer tokens beside another image (LLaVA-OneVision) has other features: a
    prompt whose image "a" spans 4 tokens takes none of the blocks of one whose image "a" spans 8, though the hit
    would end where its own image does."""
    manager = BlockManager(32, 4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    alone = sequence(0, [*range(100, 104), *[7] * 8, 60, 61], MediaInputs({}, "a", ("a",), 4, 12, ((4, 12),)))
    scheduler.add(alone)
    scheduler.schedule()
    manager.mark_computed(0, alone.num_tokens)
    scheduler.finish(alone, "stop")
    beside = MediaInputs({}, "a, b", ("a", "b"), 4, 16, ((4, 8), (12, 16)))
    scheduler.add(sequence(1, [*range(100, 104), *[7] * 4, 50, 51, 52, 53, *[7] * 4, 62], beside))
    assert chunks(scheduler.schedule()) == [(1, 4, 13)]


def test_a_prompt_that_would_leave_no_room_to_grow_waits_and_evicts_nothing():
    """A waiting prompt that would take the last free blocks (none left for the running sequences to grow into)
    waits — and takes no block meanwhile, so the prefix cache keeps the system prompt it held in them."""
    manager = BlockManager(10, 4)
    manager.add_sequence("system prompt", [*SYSTEM, 1])
    manager.free("system prompt")  # its three full blocks stay in the prefix cache, among the free ones
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    running(scheduler, [list(range(40, 55))])  # 4 blocks held, 6 free
    scheduler.add(sequence(1, list(range(60, 84))))  # 24 tokens: 6 blocks
    assert chunks(scheduler.schedule()) == [(0, 15, 1)] and [seq.seq_id for seq in scheduler.waiting] == [1]
    assert manager.prefix_hit([*SYSTEM, 2]).tokens == 12
