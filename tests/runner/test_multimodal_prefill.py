"""The runner's multimodal prefill (``hfaccel.runner.multimodal.prefill_sequence``, the Engine's): a prompt with
images through the model's own forward into the pool, then decode steps — eager forwards and the static steps —
whose position ids continue past the image's M-RoPE positions (Qwen2.5-VL): transformers' tokens for each prompt."""

import pytest
import torch

from hfaccel import compat
from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool, PromptCache
from hfaccel.kv.hf_cache import PagedKV
from hfaccel.runner import ModelRunner
from hfaccel.runner.multimodal import prefill_sequence
from tests.hf.vlm_models import CASES, image, served_case

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


@pytest.mark.parametrize(
    "name", ["qwen2_5_vl", "qwen3_vl", "gemma3", "gemma4", "llava", "mistral3", "smolvlm", "llama4"]
)
def test_a_prefill_after_held_tokens_gives_the_whole_prompts_logits_and_offset(name):
    """A prompt's text before its images prefilled first, then the rest with its images after those tokens
    (``past_ids``: prefix-cache hits): the last token's logits and the position offset (Qwen2.5-VL's M-RoPE) of the
    prompt prefilled whole, and the pool holds the same K/V. transformers 5.17 cannot continue such a prompt: a
    ValueError says so."""
    case = served_case(name)
    model = case.model()
    inputs = case.inputs([[*range(60, 80), image(40, 40, 1), 10, image(60, 30, 2), 11]])
    ids, media = inputs["input_ids"][0], _media(inputs)
    held = 16  # two blocks of 8, all text
    assert (ids[:held] < 200).all()  # before the images' tokens
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=-(-ids.shape[0] // 8) * 2, block_size=8))
    runner.pool.reserve(["whole", "split"], [ids.shape[0]] * 2)
    with hfaccel_attention(model, "torch"):
        whole = prefill_sequence(model, runner, "whole", ids, media)
        prefill_sequence(model, runner, "split", ids[:held], {})
        if not compat.continues_multimodal_prompts(model):  # transformers 5.17
            with pytest.raises(ValueError, match="prefills a prompt with images from its first token"):
                prefill_sequence(model, runner, "split", ids[held:], media, past_ids=ids[:held].tolist())
            return
        split = prefill_sequence(model, runner, "split", ids[held:], media, past_ids=ids[:held].tolist())
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert runner.position_offsets.get("split") == runner.position_offsets.get("whole")
    assert name.startswith("qwen") == ("whole" in runner.position_offsets)  # Qwen's images span fewer positions
    pool = runner.pool
    for layer in pool.place:  # the layers that keep K/V (Gemma 4 shares some)
        keys = [
            PagedKV(
                **pool.layer_view(layer), block_tables=pool.block_tables([seq]), seq_lens=None, max_seq_len=ids.shape[0]
            ).gather()[0]
            for seq in ("whole", "split")
        ]
        torch.testing.assert_close(keys[1], keys[0], rtol=1e-5, atol=1e-5)


def test_a_prefill_after_held_tokens_refuses_padding():
    case = CASES["qwen2_5_vl"]
    model = case.model()
    pool = KVPool.for_model(model, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="after 3 tokens held takes rows without padding"):
        PromptCache(model.config, pool, ["a"], [2], past=3)
