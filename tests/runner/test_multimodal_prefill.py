"""The runner's multimodal prefill (``hfaccel.runner.multimodal.prefill_sequence``, the Engine's): a prompt with
images through the model's own forward into the pool, then decode steps — eager forwards and the static steps —
whose position ids continue past the image's M-RoPE positions (Qwen2.5-VL): transformers' tokens for each prompt."""

import pytest
import torch

from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool
from hfaccel.runner import ModelRunner
from hfaccel.runner.multimodal import prefill_sequence
from tests.hf.vlm_models import CASES, image

NEW_TOKENS = 10
PROMPTS = [[5, 6, image(120, 90), 7, 8], [20, 21, 22, 23], [9, image(40, 40, 1), 10, image(60, 30, 2), 11]]


@pytest.mark.parametrize("static", [False, True], ids=["eager forwards", "static steps"])
def test_decode_continues_each_sequences_positions(static):
    case = CASES["qwen2_5_vl"]
    model = case.model()
    singles = [case.inputs([prompt]) for prompt in PROMPTS]
    expected = [
        model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, -NEW_TOKENS:].tolist()
        for inputs in singles
    ]
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=32, block_size=16))
    if static:
        runner.enable_decode_graphs(4, 256)
    lengths = [inputs["input_ids"].shape[1] for inputs in singles]
    seq_ids = list(range(len(PROMPTS)))
    runner.pool.reserve(seq_ids, [n + NEW_TOKENS for n in lengths])
    with hfaccel_attention(model, "torch"):
        logits = torch.cat(
            [
                prefill_sequence(model, runner, seq, inputs["input_ids"][0], _media(inputs))
                for seq, inputs in zip(seq_ids, singles)
            ]
        )  # [S, V]
        assert set(runner.position_offsets) == {0, 2}  # the prompts with images
        tokens = [logits.argmax(-1)]
        for step in range(NEW_TOKENS - 1):
            logits = runner.forward(seq_ids, tokens[-1], [1] * len(seq_ids), starts=[n + step for n in lengths])
            tokens.append(logits.argmax(-1))
    assert torch.stack(tokens, 1).tolist() == expected
    for seq in seq_ids:
        runner.free(seq)
    assert not runner.position_offsets


def _media(inputs: dict) -> dict:
    """A prompt's multimodal inputs: everything but its token ids and mask."""
    return {name: value for name, value in inputs.items() if name not in ("input_ids", "attention_mask")}
