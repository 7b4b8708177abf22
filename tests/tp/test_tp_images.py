"""``hfaccel.Engine`` over a vision-language model transformers sharded with ``tp_plan="auto"`` on 2 ranks (gloo): its
language model split over the ranks, its vision tower whole on each (Qwen2.5-VL, Gemma 3), so the leader encodes the
images ahead, alone (transformers 5.17: each rank's forward encodes them). Each prompt with images is prefilled on
every rank through the model's own forward (the leader broadcasts its tokens, blocks and inputs), and the text after
its images continues at their position offset on every rank — in eager and in static decode steps: the outputs
(tokens and their log-probabilities) equal the single-process engine's, for a mixed batch, a prompt repeating
another's images past them (a prefix hit), an image again, and a prompt sharing another's text before its images (a
prefix hit before them)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hfaccel import compat
from hfaccel.engine import SamplingParams
from tests.hf.vlm_models import CASES, image
from tests.tp.ranks import run_ranks

ENGINE = {"max_num_seqs": 4, "num_blocks": 64, "block_size": 8}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
# two completions (forks: copy-on-write block copies go out with the steps) and the prompt's logprobs (kept rows)
FORKED = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0, n=2, prompt_logprobs=1)


def _processed(case, prompt: list, images_of: list | None = None) -> dict:
    """A prompt the family's processor made: ``{"prompt_token_ids", "multimodal_inputs"}`` (those of ``images_of``'s
    images with ``images_of``: inputs that do not match the prompt's placeholders)."""
    inputs = case.inputs([prompt])
    media = case.inputs([images_of]) if images_of is not None else inputs
    media = {k: v for k, v in media.items() if k not in ("input_ids", "attention_mask")}
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "multimodal_inputs": media}


def _rounds(name: str) -> list[list]:
    """Four rounds of requests: a mixed batch (one image, with two completions and its prompt's logprobs: FORKED;
    text alone; two images); a follow-up repeating the two-image prompt past its images and the one-image prompt again;
    a prompt whose images do not match its placeholders (the model's forward raises on every rank) with a text one;
    a prompt sharing a system prompt of two blocks with the first round's last, before other images (a prefix hit
    before its images: the multimodal prefill continues after it on every rank)."""
    case = CASES[name]
    pictures = [image(40, 40, 1), image(60, 30, 2)]
    system = list(range(60, 80))
    head = [*system, pictures[0], 10, pictures[1], *range(50, 62)]  # past its last image, more than a block of text
    one_image = [5, 6, image(120, 90), 7, 8]
    first = [_processed(case, one_image), [20, 21, 22, 23], _processed(case, [*head, 7])]
    mismatched = _processed(case, one_image, images_of=[5, *pictures, 7])  # two images for one placeholder
    return [
        first,
        [_processed(case, [*head, 5]), first[0]],
        [mismatched, [30, 31]],
        [_processed(case, [*system, image(50, 30, 3), 11])],
    ]


def _outputs(engine, rounds: list[list]) -> dict:
    """Per round and request: its completions' token ids and their log-probabilities, its prompt's logprobs, the
    prompt tokens it took from the prefix cache, its error."""
    seen = {"tokens": [], "logprobs": [], "prompt": [], "cached": [], "errors": []}
    for requests in rounds:
        params = [FORKED if request is requests[0] and requests is rounds[0] else GREEDY for request in requests]
        outputs = engine.generate(requests, params)
        seen["tokens"].append([[c.token_ids for c in out.outputs] for out in outputs])
        seen["logprobs"].append([[[e.logprob for e in c.logprobs or []] for c in out.outputs] for out in outputs])
        seen["prompt"].append([[e.logprob for e in out.prompt_logprobs or [] if e is not None] for out in outputs])
        seen["cached"].append([out.metrics.num_cached_tokens for out in outputs])
        seen["errors"].append([out.error for out in outputs])
    return seen


def _engine_rank(path: str, name: str, cuda_graphs: bool) -> dict:
    import hfaccel

    model = transformers.AutoModelForImageTextToText.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=cuda_graphs, **ENGINE)
    result = {"kv_heads": engine.runner.pool.group_shapes[0][0]}
    if not engine.is_leader:
        return {**result, "forwards": engine.follow()}
    try:
        result.update(_outputs(engine, _rounds(name)))
        result["copies"] = engine.runner.pool.copies_made
        result["stats"], result["hits"] = engine.stats(), engine.encoder_cache.hits
        result["ahead"] = engine.encoder_cache.ahead
    finally:
        engine.shutdown()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager steps", "static steps"])
def test_image_requests_under_tp_equal_single_process(name, cuda_graphs, tmp_path):
    import hfaccel

    model = CASES[name].model()
    model.save_pretrained(tmp_path / "model")
    single = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=cuda_graphs, **ENGINE)
    expected = _outputs(single, _rounds(name))

    leader, follower = run_ranks(
        _engine_rank, str(tmp_path / "model"), name, cuda_graphs, workdir=tmp_path, timeout=240
    )

    assert leader["tokens"] == expected["tokens"] and leader["errors"] == expected["errors"]
    assert expected["errors"][2][0] is not None and expected["errors"][2][1] is None  # failed alone
    # the ranks' partial sums add up in another order than one process's: equal up to fp32 rounding
    for part in ("logprobs", "prompt"):
        torch.testing.assert_close(leader[part], expected[part], rtol=0, atol=1e-5)
    assert leader["cached"] == expected["cached"] and leader["cached"][1][0] > 0  # the follow-up's prefix hit
    assert leader["cached"][3][0] == (16 if compat.continues_multimodal_prompts(model) else 0)  # before its image
    assert leader["ahead"] and leader["hits"] == single.encoder_cache.hits  # the vision tower is whole on each rank
    assert leader["stats"]["blocks_used"] == 0
    assert leader["kv_heads"] == follower["kv_heads"] == single.runner.pool.group_shapes[0][0] // 2
    assert follower["forwards"] > 0 and leader["copies"] > 0  # the forks' copies reached the follower too


def _generate_rank(path: str, batch: dict) -> dict:
    import hfaccel

    model = transformers.AutoModelForImageTextToText.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    hfaccel.accelerate(model, attention="torch")  # "torch": hfaccel's decode loop on the CPU too
    return {"tokens": model.generate(**batch, max_new_tokens=8, do_sample=False), "decode": str(model.hfaccel.decode)}


@pytest.mark.slow
def test_generate_with_images_under_tp_equals_single_process(tmp_path):
    """``generate()`` of a sharded Qwen2.5-VL: every rank runs the multimodal prefill and hfaccel's decode loop in
    lockstep on a left-padded batch mixing prompts with images and a text-only one — transformers' tokens."""
    case = CASES["qwen2_5_vl"]
    model = case.model()
    model.save_pretrained(tmp_path / "model")
    batch = case.inputs([[5, 6, image(120, 90), 7, 8], [20, 21, 22], [9, image(40, 40, 1), 10, image(60, 30, 2)]])
    expected = model.generate(**batch, max_new_tokens=8, do_sample=False)

    ranks = run_ranks(_generate_rank, str(tmp_path / "model"), batch, workdir=tmp_path, timeout=120)

    for rank, got in enumerate(ranks):
        assert got["decode"] == "hfaccel", f"rank {rank}: {got['decode']}"
        assert torch.equal(got["tokens"], expected), f"rank {rank}"


def _one_rank_short_of_memory_rank(path: str, failing: str) -> dict:
    """The engine on this rank; the ``failing`` rank's ("leader" or "follower") multimodal prefills run out of
    memory (there alone: the other rank goes into the forward's collectives). What each rank's engine ended with."""
    import datetime

    import hfaccel
    from hfaccel.distributed import TensorParallelError, steps
    from hfaccel.runner import runner as runner_module

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory in the vision tower (on this rank alone)")

    steps.VERDICT_TIMEOUT = datetime.timedelta(seconds=3)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=False, **ENGINE)
    if failing == ("leader" if engine.is_leader else "follower"):
        runner_module.prefill_sequence = steps.prefill_on_blocks = out_of_memory  # this process's forwards only
    try:
        if not engine.is_leader:
            return {"followed": engine.follow()}
        return {"outputs": engine.generate([_processed(CASES["qwen2_5_vl"], [5, 6, image(40, 40), 7])], GREEDY)}
    except TensorParallelError as error:
        return {"error": str(error), "cause": repr(error.__cause__)}
    finally:
        engine.shutdown()  # sends nothing once the ranks diverged


@pytest.mark.slow
@pytest.mark.parametrize("failing", ["follower", "leader"])
def test_a_prefill_failing_on_one_rank_alone_stops_every_rank(failing, tmp_path):
    """A multimodal prefill that raises on one TP rank alone (out of memory there) leaves the other inside the
    forward's collectives: the failing rank gets no outcome from it in time and stops with TensorParallelError, and
    so does the other once its collective fails (its peer gone) — no rank waits forever, the leader's generate()
    raises instead of answering, and the follower's follow() ends."""
    CASES["qwen2_5_vl"].model().save_pretrained(tmp_path / "model")

    leader, follower = run_ranks(
        _one_rank_short_of_memory_rank, str(tmp_path / "model"), failing, workdir=tmp_path, timeout=120
    )

    ranks = {"leader": leader, "follower": follower}
    assert "error" in leader and "error" in follower, ranks
    alone = ranks[failing]
    assert "not every rank said it raised there too" in alone["error"], alone
    assert "OutOfMemoryError" in alone["cause"], alone
