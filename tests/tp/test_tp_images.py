"""``hfaccel.Engine`` over a vision-language model transformers sharded with ``tp_plan="auto"`` on 2 ranks (gloo): its
language model split over the ranks, its vision tower whole on each (Qwen2.5-VL, Gemma 3), so the leader encodes the
images ahead, alone (transformers 5.17: each rank's forward encodes them). Each prompt with images is prefilled on
every rank through the model's own forward (the leader broadcasts its tokens, blocks and inputs), and the text after
its images continues at their position offset on every rank — in eager and in static decode steps: the outputs
(tokens and their log-probabilities) equal the single-process engine's, for a mixed batch, a prompt repeating
another's images past them (a prefix hit), and an image again."""

from __future__ import annotations

import pytest
import torch
import transformers

from hfaccel.engine import SamplingParams
from tests.hf.vlm_models import CASES, image
from tests.tp.ranks import run_ranks

ENGINE = {"max_num_seqs": 4, "num_blocks": 64, "block_size": 8}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def _processed(case, prompt: list) -> dict:
    """A prompt the family's processor made: ``{"prompt_token_ids", "multimodal_inputs"}``."""
    inputs = case.inputs([prompt])
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "multimodal_inputs": media}


def _rounds(name: str) -> list[list]:
    """Two rounds of requests: a mixed batch (one image, text alone, two images), then a follow-up repeating the
    two-image prompt past its images and the one-image prompt again."""
    case = CASES[name]
    pictures = [image(40, 40, 1), image(60, 30, 2)]
    head = [9, pictures[0], 10, pictures[1], *range(50, 62)]  # past its last image, more than a block of text
    first = [
        _processed(case, [5, 6, image(120, 90), 7, 8]),
        [20, 21, 22, 23],
        _processed(case, [*head, 7]),
    ]
    return [first, [_processed(case, [*head, 5]), first[0]]]


def _outputs(engine, rounds: list[list]) -> tuple[list, list, list]:
    """Each round's token ids, their log-probabilities, and the prompt tokens each request took from the prefix
    cache."""
    tokens, logprobs, cached = [], [], []
    for requests in rounds:
        outputs = engine.generate(requests, GREEDY)
        tokens.append([out.outputs[0].token_ids for out in outputs])
        logprobs.append([[entry.logprob for entry in out.outputs[0].logprobs] for out in outputs])
        cached.append([out.metrics.num_cached_tokens for out in outputs])
    return tokens, logprobs, cached


def _engine_rank(path: str, name: str, cuda_graphs: bool) -> dict:
    import hfaccel

    model = transformers.AutoModelForImageTextToText.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=cuda_graphs, **ENGINE)
    result = {"kv_heads": engine.runner.pool.group_shapes[0][0]}
    if not engine.is_leader:
        return {**result, "forwards": engine.follow()}
    try:
        result["tokens"], result["logprobs"], result["cached"] = _outputs(engine, _rounds(name))
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
    expected, logprobs, expected_cached = _outputs(single, _rounds(name))

    leader, follower = run_ranks(
        _engine_rank, str(tmp_path / "model"), name, cuda_graphs, workdir=tmp_path, timeout=240
    )

    assert leader["tokens"] == expected
    # the ranks' partial sums add up in another order than one process's: equal up to fp32 rounding
    torch.testing.assert_close(leader["logprobs"], logprobs, rtol=0, atol=1e-5)
    assert leader["cached"] == expected_cached and leader["cached"][1][0] > 0  # the follow-up's prefix hit
    assert leader["ahead"] and leader["hits"] == single.encoder_cache.hits  # the vision tower is whole on each rank
    assert leader["stats"]["blocks_used"] == 0
    assert leader["kv_heads"] == follower["kv_heads"] == single.runner.pool.group_shapes[0][0] // 2
    assert follower["forwards"] > 0


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
