"""Image-text-to-text models under ``accelerate()``: the language model on hfaccel's attention, the vision encoder on
transformers', and ``generate`` with images on hfaccel's decode loop — the multimodal prefill through transformers'
own forward into hfaccel's pool, then hfaccel's decode steps — giving transformers' tokens (fp32): one image, two
images in one prompt, a left-padded batch mixing image and text-only prompts."""

import pytest
import torch
import transformers

import hfaccel
from hfaccel.attention import attention_implementations
from tests.hf.vlm_models import CASES, image, served_case

NEW_TOKENS = 12
ONE_IMAGE = [[5, 6, image(60, 45), 7, 8]]
TWO_IMAGES = [[9, image(30, 30, 1), 10, 11, 12, 13, 14, image(40, 50, 2), 15]]
MIXED = ONE_IMAGE + TWO_IMAGES + [[20, 21, 22, 23]]  # left-padded: two image prompts and a text-only one
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
SERVED = sorted(CASES)


@pytest.mark.parametrize("family", SERVED)
def test_images_through_hfaccels_loop_give_transformers_tokens(family):
    case = served_case(family)
    model = case.model()
    batches = {"one image": ONE_IMAGE, "two images": TWO_IMAGES, "mixed batch": MIXED, "text only": [[20, 21, 22]]}
    if case.per_row:  # SmolVLM's processor batches images per prompt: every prompt of a batch has one
        batches["mixed batch"] = ONE_IMAGE + TWO_IMAGES + [[20, 21, image(20, 30, 3), 22]]
    inputs = {name: case.inputs(prompts) for name, prompts in batches.items()}
    expected = {name: model.generate(**batch, **GREEDY) for name, batch in inputs.items()}
    hfaccel.accelerate(model, attention="torch")
    assert model.hfaccel.active, model.hfaccel.fallback_reason
    for name, batch in inputs.items():
        assert torch.equal(model.generate(**batch, **GREEDY), expected[name]), name
        assert str(model.hfaccel.decode) == "hfaccel", name
    assert "hfaccel paged (torch)" in model.hfaccel.attention_paths.counts


def test_triton_kernels_serve_the_language_model():
    """Qwen2.5-VL's M-RoPE text (positions continuing past an image's) on hfaccel's Triton kernels (interpreted)."""
    case = CASES["qwen2_5_vl"]
    model = case.model()
    inputs = case.inputs(MIXED)
    expected = model.generate(**inputs, **GREEDY)
    hfaccel.accelerate(model, attention="triton", compile=False)
    assert torch.equal(model.generate(**inputs, **GREEDY), expected)
    assert str(model.hfaccel.decode) == "hfaccel"
    assert set(model.hfaccel.attention_paths.counts) == {"hfaccel flash (triton)", "hfaccel paged (triton)"}


def test_compiled_decode_steps_equal_eager_ones():
    case = CASES["qwen2_5_vl"]
    model = case.model()
    inputs = case.inputs(MIXED)
    hfaccel.accelerate(model, attention="torch", compile=False)
    eager = model.generate(**inputs, **GREEDY)
    hfaccel.accelerate(model, attention="torch", compile=True)
    assert torch.equal(model.generate(**inputs, **GREEDY), eager)
    assert str(model.hfaccel.decode) == "hfaccel"
    assert model.hfaccel.session.steps() == "compiled"


def test_position_offsets_decide_the_tokens():
    """Qwen's text after an image continues from the image's last M-RoPE position, fewer than its tokens: decode
    steps that took the cache positions instead would give other tokens (the test models are built to show it)."""
    case = CASES["qwen2_5_vl"]
    model = case.model()
    inputs = case.inputs(MIXED)
    hfaccel.accelerate(model, attention="torch")
    expected = model.generate(**inputs, **GREEDY)
    runner = model.hfaccel.session.runner
    offsets = runner.position_offsets
    runner.position_offsets = _Forgetful()
    try:
        assert not torch.equal(model.generate(**inputs, **GREEDY), expected)
    finally:
        runner.position_offsets = offsets


class _Forgetful(dict):
    """Position offsets that are never kept."""

    def __setitem__(self, key, value):
        pass


def test_seeded_sampling_equals_transformers():
    case = CASES["gemma3"]
    model = case.model()
    inputs = case.inputs(MIXED)
    sampled = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=50, temperature=1.5)
    torch.manual_seed(7)
    expected = model.generate(**inputs, **sampled)
    hfaccel.accelerate(model, attention="torch")
    torch.manual_seed(7)
    assert torch.equal(model.generate(**inputs, **sampled), expected)
    assert str(model.hfaccel.decode) == "hfaccel"


def test_vision_encoder_keeps_its_attention_and_restore_undoes_it():
    case = CASES["llava"]
    model = case.model()
    before = attention_implementations(model)
    hfaccel.accelerate(model, attention="torch")
    now = attention_implementations(model)
    assert now["text_config"] == now[""] == "hfaccel_torch"
    assert now["vision_config"] == before["vision_config"]
    assert "vision_config" in str(model.hfaccel)
    hfaccel.restore(model)
    assert attention_implementations(model) == before
    assert "generate" not in vars(model)


def test_hybrid_model_with_images_keeps_each_rows_state_in_its_slot():
    """Qwen3.5 (linear-attention layers keep recurrent state): the multimodal prefill runs transformers' recurrent
    layers on the padded batch and stores each row's state in its sequence's slot, which the compiled decode steps
    then read and write — transformers' tokens, every slot given back."""
    case = CASES["qwen3_5"]
    model = case.model()
    inputs = case.inputs(MIXED)
    expected = model.generate(**inputs, **GREEDY)
    hfaccel.accelerate(model, attention="torch", compile=True)
    assert torch.equal(model.generate(**inputs, **GREEDY), expected)
    assert str(model.hfaccel.decode) == "hfaccel" and model.hfaccel.session.steps() == "compiled"
    pool = model.hfaccel.session.runner.pool
    assert pool.states is not None and pool.manager.num_free_state_slots == pool.states.num_slots


def test_image_text_to_text_pipeline_keeps_working():
    from tests.hf.vlm_models import llava_with_processor

    model, processor = llava_with_processor()
    pipe = transformers.pipeline("image-text-to-text", model=model, processor=processor)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image(40, 50)}, {"type": "text", "text": "What is this?"}],
        }
    ]
    expected = pipe(text=messages, max_new_tokens=8, do_sample=False)
    hfaccel.accelerate(model, attention="torch")
    assert pipe(text=messages, max_new_tokens=8, do_sample=False) == expected
    assert str(model.hfaccel.decode) == "hfaccel"
