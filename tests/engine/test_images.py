"""The Engine with images: prompts with images (chat messages with image parts, or a prompt and its images) prefilled
whole through the model's own forward, decoded in the batch with every other request — each request's tokens those
of transformers' ``generate`` on it alone (fp32), mixed with text-only requests, after preemption too; prompts that
repeat another's images and its text up to past them take its blocks from the prefix cache, and a chat's next turn
adding an image those up to it; bad images fail their request alone."""

import io
from dataclasses import replace

import pytest
import torch
from PIL import Image

import hfaccel
from hfaccel import compat
from hfaccel.engine.inputs import PreparedPrompt
from tests.hf.vlm_models import gemma3_with_processor, image, llava_with_processor

GREEDY = hfaccel.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def chat(text: str, *images) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [*({"type": "image", "image": picture} for picture in images), {"type": "text", "text": text}],
        }
    ]


@pytest.fixture(scope="module")
def llava():
    return llava_with_processor()


def transformers_tokens(model, processor, prompt, max_new_tokens: int = 10) -> list[int]:
    """transformers' greedy tokens for one prompt alone (a chat, a ``{"prompt", "images"}`` dict or a text)."""
    inputs = _processed_alone(processor, prompt)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _processed_alone(processor, prompt) -> dict:
    """The processor's inputs for one prompt (a chat, a ``{"prompt", "images"}`` dict or a text)."""
    if isinstance(prompt, dict):
        return processor(text=[prompt["prompt"]], images=prompt["images"], return_tensors="pt")
    if isinstance(prompt, str):
        return processor(text=[prompt], return_tensors="pt")
    return processor.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def _prompts() -> list:
    """Chats with one and two images, a text prompt, a prompt and its images (a PIL image, then encoded PNG bytes),
    a chat with no image."""
    png = io.BytesIO()
    image(25, 35, 4).save(png, format="PNG")
    return [
        chat("What is this?", image(40, 50)),
        chat("Compare these", image(30, 30, 1), image(60, 20, 2)),
        "user: hello there\nassistant:",
        {"prompt": "user: <image> and <image>, again?\nassistant:", "images": [image(40, 50), png.getvalue()]},
        chat("Only text in a chat"),
    ]


def test_mixed_batch_equals_each_request_alone(llava):
    model, processor = llava
    prompts = _prompts()
    expected = [transformers_tokens(model, processor, _decoded(p)) for p in prompts]
    engine = hfaccel.Engine(model, processor, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.error for o in outputs] == [None] * len(prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _decoded(prompt):
    """The prompt with its encoded images opened (what transformers' processor takes)."""
    if isinstance(prompt, dict):
        return {
            **prompt,
            "images": [
                Image.open(io.BytesIO(p)).convert("RGB") if isinstance(p, bytes) else p for p in prompt["images"]
            ],
        }
    return prompt


def test_preempted_image_requests_are_computed_again_with_their_images(llava):
    """A pool too small for every request at once: image requests are preempted and recomputed (their prompt and
    the tokens they had, through the multimodal prefill again) — the same tokens."""
    model, processor = llava
    prompts = [
        chat("What is this?", image(40, 50)),
        chat("Compare", image(30, 30, 1)),
        chat("Once more?", image(20, 30, 3)),
    ]
    params = hfaccel.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [transformers_tokens(model, processor, p, 24) for p in prompts]
    engine = hfaccel.Engine(
        model,
        processor,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        num_blocks=6,
        block_size=16,
        enable_prefix_caching=False,
    )
    outputs = engine.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_bad_images_fail_their_request_alone(llava):
    model, processor = llava
    engine = hfaccel.Engine(model, processor, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64)
    good = chat("What is this?", image(40, 50))
    bad = [
        chat("Broken", b"not an image"),
        {"prompt": "user: <image>\nassistant:", "images": []},
        {"prompt": "user: <image>\nassistant:", "images": [image(20, 20), image(20, 20)]},
        chat("Too big", Image.new("1", (9000, 8000))),
        {"prompt": "x", "images": [image(10, 10)], "extra": 1},
        [{"role": "user", "content": [{"type": "video", "url": "clip.mp4"}, {"type": "text", "text": "and this?"}]}],
    ]
    outputs = engine.generate([good, *bad], GREEDY)
    assert outputs[0].error is None
    assert outputs[0].outputs[0].token_ids == transformers_tokens(model, processor, good)
    errors = [o.error for o in outputs[1:]]
    assert "not an image that can be decoded" in errors[0]
    assert "processor rejected" in errors[1]
    # more images than placeholders: transformers 5.24's processor refuses them; 5.17's lets them through and the
    # model's forward refuses them in the step, which fails this request alone
    assert "processor rejected" in errors[2] or "image tokens do not match" in errors[2]
    assert "pixels" in errors[3]
    assert "'prompt' and 'images'" in errors[4]
    assert "message 0's part 0 is a video part" in errors[5]
    assert engine.stats()["blocks_used"] == 0


def test_images_are_told_apart_where_each_is_one_run_of_image_placeholders():
    """Each image's span where the prompt's image placeholders form one run per image; not where two touch, where an
    image is tiled into several runs, or where the prompt has a video's placeholders (no image's hash holds them)."""
    from types import SimpleNamespace

    from hfaccel.engine.media import MediaInputs

    config = SimpleNamespace(image_token_id=9, video_token_id=8)
    two = MediaInputs({}, "a, b", ("a", "b"))
    assert two.located([1, 9, 9, 2, 9, 3], config).spans == ((1, 3), (4, 5))
    assert [u[:2] for u in two.located([1, 9, 9, 2, 9, 3], config).units] == [(1, 3), (4, 5)]
    for prompt in ([1, 9, 9, 9, 3], [1, 9, 2, 9, 2, 9, 3], [1, 9, 2, 8, 8, 2, 9, 3]):
        located = two.located(prompt, config)
        assert located.spans == () and located.units == ((1, len(prompt) - 1, "a, b"),)
    assert two.located([1, 2, 3], config).units == ()


def test_a_text_model_refuses_images():
    from tests.serve.agent_models import smollm2_tokenizer, tiny_model_over

    tokenizer = smollm2_tokenizer()
    engine = hfaccel.Engine(tiny_model_over(tokenizer), tokenizer, num_blocks=16)
    with pytest.raises(ValueError, match="image-text-to-text model and its processor"):
        engine.add_request(chat("What is this?", image(40, 50)), GREEDY)
    assert not engine.has_unfinished_requests()


def test_lora_adapters_serve_image_requests(llava, tmp_path):
    """A LoRA adapter of the language model on requests with images, in one batch with the base model's: each
    request's tokens are PEFT's own generate on it alone. An adapter that also targets the vision tower (which runs
    without adapters) serves text requests, and image requests with it are refused, saying why."""
    from tests.lora.adapters import save_adapter

    model, processor = llava
    peft = save_adapter(model, tmp_path / "a", r=4, seed=0, target_modules=r".*language_model.*\.(q|v|down)_proj")
    prompts = [chat("What is this?", image(40, 50)), chat("Compare", image(30, 30, 1))]
    with_adapter = [transformers_tokens(peft, processor, prompt) for prompt in prompts]
    base = [transformers_tokens(model, processor, prompt) for prompt in prompts]
    assert with_adapter != base
    save_adapter(model, tmp_path / "vision", r=4, seed=1, target_modules=r".*vision_tower.*\.q_proj")
    engine = hfaccel.Engine(model, processor, num_blocks=64, lora_adapters={"a": tmp_path / "a"})
    try:
        outputs = engine.generate(prompts * 2, GREEDY, lora=["a", "a", None, None])
        assert [o.outputs[0].token_ids for o in outputs] == with_adapter + base
        engine.add_lora("vision", tmp_path / "vision")
        with pytest.raises(ValueError, match="cannot take LoRA adapter 'vision': it targets 2 layers outside the"):
            engine.add_request(chat("What?", image(40, 50)), GREEDY, lora="vision")
        text = engine.generate(["user: hello\nassistant:"], GREEDY, lora="vision")[0]
        assert text.error is None and len(text.outputs[0].token_ids) == GREEDY.max_tokens
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()


def test_prompt_logprobs_of_image_prompts_equal_transformers(llava):
    """prompt_logprobs of a prompt with images (how an evaluation harness scores a multimodal answer), in one step
    with a text prompt asking for them too: each prompt token's log-probability, the image's placeholders included,
    is transformers' log-softmax of the model's forward on that prompt alone (fp32); the first has none."""
    model, processor = llava
    prompts = [chat("What is this?", image(40, 50)), "user: hello there\nassistant:"]
    engine = hfaccel.Engine(model, processor, num_blocks=64)
    outputs = engine.generate(prompts, hfaccel.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    for prompt, out in zip(prompts, outputs):
        inputs = _processed_alone(processor, prompt)
        ids = inputs["input_ids"][0]
        with torch.no_grad():
            logits = model(**inputs).logits[0]  # [L, V]
        expected = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        entries = out.prompt_logprobs
        assert out.prompt_token_ids == ids.tolist() and entries[0] is None
        assert [entry.token_id for entry in entries[1:]] == ids[1:].tolist()
        torch.testing.assert_close(
            torch.tensor([entry.logprob for entry in entries[1:]]), expected, rtol=1e-4, atol=1e-4
        )


def test_the_same_image_again_skips_the_encoder(llava):
    """A request whose images were encoded before takes the encoder's outputs from the cache (transformers >= 5.24,
    which takes encoded images): the same tokens."""
    model, processor = llava
    engine = hfaccel.Engine(model, processor, num_blocks=32)
    prompt = chat("What is this?", image(40, 50))
    first = engine.generate([prompt], GREEDY)[0].outputs[0].token_ids
    again = engine.generate([chat("What is this?", image(40, 50))], GREEDY)[0].outputs[0].token_ids
    assert first == again == transformers_tokens(model, processor, prompt)
    if compat.takes_encoded_media(model):
        assert (engine.encoder_cache.hits, engine.encoder_cache.misses) == (1, 1)
    else:  # transformers 5.17: the forward encodes its pixels, every request its own
        assert engine.encoder_cache.hits == 0


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager steps", "static steps"])
def test_processed_prompts_continue_their_mrope_positions(cuda_graphs):
    """Prompts a processor made already (Qwen2.5-VL: its processor needs torchvision, so the test builds its inputs
    as tests/hf/vlm_models does) — text after an image continues from the image's M-RoPE positions in the engine's
    decode steps too: each request's tokens those of transformers on it alone, mixed with a text-only request."""
    from tests.hf.vlm_models import CASES

    case = CASES["qwen2_5_vl"]
    model = case.model()
    prompts = [[5, 6, image(120, 90), 7, 8], [20, 21, 22, 23], [9, image(40, 40, 1), 10, image(60, 30, 2), 11]]
    singles = [case.inputs([prompt]) for prompt in prompts]
    expected = [
        model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)[
            0, inputs["input_ids"].shape[1] :
        ]
        for inputs in singles
    ]
    expected = [tokens.tolist() for tokens in expected]
    engine = hfaccel.Engine(model, max_num_seqs=4, num_blocks=32, cuda_graphs=cuda_graphs)
    requests = [
        {
            "prompt_token_ids": inputs["input_ids"][0].tolist(),
            "multimodal_inputs": {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
        }
        for inputs in singles
    ]
    requests[1] = singles[1]["input_ids"][0].tolist()  # the text-only one as plain token ids
    outputs = engine.generate(requests, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.stats()["decode_steps"].startswith("uncompiled") == cuda_graphs


def _processed(case, prompt: list, max_new_tokens: int = 10) -> tuple[dict, list[int]]:
    """A prompt the family's processor made (``{"prompt_token_ids", "multimodal_inputs"}``) and transformers' greedy
    tokens for it alone."""
    inputs = case.inputs([prompt])
    model = case_model(case)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)  # ignore_eos
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(expected) == max_new_tokens
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "multimodal_inputs": media}, expected


_MODELS: dict = {}


def case_model(case):
    if case.name not in _MODELS:
        _MODELS[case.name] = case.model()
    return _MODELS[case.name]


def test_a_hybrid_models_image_requests_keep_their_state_in_slots():
    """Qwen3.5 (linear-attention layers keep recurrent state): each image request's prefill stores its recurrent
    state in its sequence's slot, decoded in the batch with a text-only request — transformers' tokens on each alone,
    after preemption too (the prompt, images and tokens computed again from a fresh state), every slot given back."""
    from tests.hf.vlm_models import CASES

    case = CASES["qwen3_5"]
    model = case_model(case)
    prompts = [[5, 6, image(60, 45), 7, 8], [20, 21, 22, 23], [9, image(30, 30, 1), 10, image(40, 50, 2), 11]]
    singles = [case.inputs([prompt]) for prompt in prompts]
    expected = [model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, -24:].tolist() for inputs in singles]
    requests = [
        {
            "prompt_token_ids": inputs["input_ids"][0].tolist(),
            "multimodal_inputs": {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
        }
        for inputs in singles
    ]
    params = hfaccel.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = hfaccel.Engine(model, max_num_seqs=3, num_blocks=8, block_size=8)  # 64 slots: 99 tokens preempt
    outputs = engine.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    manager = engine.runner.pool.manager
    assert engine.stats()["blocks_used"] == 0 and manager.num_free_state_slots == engine.runner.pool.states.num_slots


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3", "llama4"])
def test_prompts_repeating_images_take_prefix_hits_past_them(name):
    """A follow-up that repeats a prompt's images and its text up to past them (a chat's next turn) takes those
    blocks from the prefix cache and computes only the text after them — at the M-RoPE position offset the images
    gave (Qwen2.5-VL), after their bidirectional attention (Gemma 3): transformers' tokens on it alone, and so for
    the request that computed them. The same text with other images, or the same images in another text, takes
    none. The first prompt has two completions (n=2): each continues at the images' offset."""
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    pictures = [image(40, 40, 1), image(60, 30, 2)]
    head = [9, *pictures[:1], 10, *pictures[1:], *range(50, 62)]  # past its last image, more than a block of text
    first, first_expected = _processed(case, [*head, 7])
    follow_up, follow_up_expected = _processed(case, [*head, 5])
    other_images, other_expected = _processed(case, [9, image(40, 40, 3), 10, *pictures[1:], *range(50, 62), 13])
    engine = hfaccel.Engine(case_model(case), max_num_seqs=4, num_blocks=64, block_size=8)
    greedy_pair = hfaccel.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)
    done = engine.generate([first], greedy_pair)[0]
    assert [o.token_ids for o in done.outputs] == [first_expected] * 2
    outputs = engine.generate([follow_up, other_images], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [follow_up_expected, other_expected]
    image_end = engine.prepare_prompt(follow_up, GREEDY).media.end
    assert image_end <= outputs[0].metrics.num_cached_tokens < len(follow_up["prompt_token_ids"])
    assert outputs[1].metrics.num_cached_tokens == 0
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "gemma3", "llama4"])
def test_prompts_sharing_text_before_their_images_take_it_from_the_prefix_cache(name):
    """Prompts that share the text before their first image (a system prompt) take its blocks from the prefix cache
    whatever their images, and the multimodal prefill computes the rest — the images after the hit, at M-RoPE
    positions counted from the prompt's start (Qwen2.5-VL), with bidirectional attention over each image (Gemma 3):
    transformers' tokens on each alone. A hit that would end inside the images (the same images, then other text) is
    cut back to before them; a text prompt shares the same blocks. transformers 5.17, which cannot continue a prompt
    with images: the image prompts are computed from their first token."""
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    system = list(range(60, 88))  # three blocks of 8 and more before the first image, which ends inside a block
    prompts = [
        [*system, image(40, 40, 1), 10, 11],
        [*system, image(30, 50, 2), 12, image(60, 30, 3), 13],
        [*system, image(40, 40, 1), 14],  # its blocks match the first's up to the one its image ends in
        [*system, 15, 16],
    ]
    requests, expected = map(list, zip(*(_processed(case, prompt) for prompt in prompts)))
    requests[3] = requests[3]["prompt_token_ids"]  # text alone
    engine = hfaccel.Engine(case_model(case), max_num_seqs=4, num_blocks=64, block_size=8)
    first = engine.generate([requests[0]], GREEDY)[0]
    outputs = [first, *engine.generate(requests[1:], GREEDY)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    starts = [engine.prepare_prompt(request, GREEDY).media.start for request in requests[:3]]
    assert all(start >= 24 for start in starts)
    continues = compat.continues_multimodal_prompts(case_model(case))  # else (5.17) computed from the first token
    hits = [start // 8 * 8 if continues else 0 for start in starts[1:]]
    assert [o.metrics.num_cached_tokens for o in outputs[:3]] == [0, *hits]
    assert outputs[3].metrics.num_cached_tokens >= 24  # the system prompt's blocks, computed with images after them
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_a_chats_next_turn_adding_an_image_takes_the_blocks_up_to_it(family):
    """A chat's next turn repeats the turn before (its image and the answer) and adds an image: each image keys the
    blocks from its own first token on, so the turn takes the blocks up to its new image from the prefix cache and
    the multimodal prefill computes the rest with that image alone (Gemma 3: bidirectional attention over it) —
    transformers' tokens on it alone. Each image is encoded once and kept on its own (the encoder cache). A turn whose
    first image differs takes nothing past the text before it; transformers 5.17, which cannot continue a prompt with
    images, computes both from their first token."""
    model, processor = llava_with_processor() if family == "llava" else gemma3_with_processor()
    turn = chat("What is this?", image(40, 50, 1))
    answer = {"role": "assistant", "content": [{"type": "text", "text": "A picture of noise, in colour."}]}
    next_turn = [*turn, answer, *chat("And this one?", image(30, 30, 2))]
    other_first = [*chat("What is this?", image(40, 50, 3)), answer, *chat("And this one?", image(30, 30, 2))]
    expected = [transformers_tokens(model, processor, p) for p in (next_turn, other_first)]
    engine = hfaccel.Engine(model, processor, max_num_seqs=4, max_num_batched_tokens=512, num_blocks=64, block_size=8)
    engine.generate([turn], GREEDY)
    outputs = engine.generate([next_turn, other_first], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    (first_start, first_end), (second_start, _) = engine.prepare_prompt(next_turn, GREEDY).media.spans
    if compat.continues_multimodal_prompts(model):
        assert first_end < outputs[0].metrics.num_cached_tokens <= second_start
        assert outputs[1].metrics.num_cached_tokens == first_start // 8 * 8
    else:
        assert [o.metrics.num_cached_tokens for o in outputs] == [0, 0]
    if compat.takes_encoded_media(model):  # each image encoded once: the turn's, then the next turns' new ones
        cache = engine.encoder_cache
        assert (cache.misses, cache.hits, cache.per_image) == (3, 2, True)
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_a_prompt_continued_between_its_images_takes_the_mrope_positions_of_the_whole_prompt(name):
    """Qwen2.5-VL and Qwen3-VL (deepstack features), their images told apart as the processor path tells them (their
    processors need torchvision): a prompt whose first image and text are a computed prompt's takes those blocks and
    computes the rest with its own second image alone — its rows of the encoded features, its M-RoPE positions those
    of the whole prompt — transformers' tokens on it alone."""
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    model = case_model(case)
    first = image(40, 40, 1)
    prompts = [[9, first, *range(50, 62), image(60, 30, 2), 11], [9, first, *range(50, 62), image(30, 50, 3), 12]]
    requests, expected = zip(*(_processed(case, prompt) for prompt in prompts))
    engine = hfaccel.Engine(model, max_num_seqs=4, num_blocks=64, block_size=8)
    computed, follow_up = (
        _told_apart(engine, request, digests) for request, digests in zip(requests, [("a", "b"), ("a", "c")])
    )
    assert engine.generate([computed])[0].outputs[0].token_ids == expected[0]
    output = engine.generate([follow_up])[0]
    assert output.outputs[0].token_ids == expected[1]
    (_, first_end), (second_start, _) = follow_up.media.spans
    if compat.continues_multimodal_prompts(model):
        assert first_end < output.metrics.num_cached_tokens <= second_start
    assert engine.stats()["blocks_used"] == 0


def _told_apart(engine, request: dict, digests: tuple[str, ...]) -> PreparedPrompt:
    """A prompt a processor made, prepared with each of its images hashed alone (a prompt the Engine processes
    itself has its images' hashes; one given made has them hashed together)."""
    prepared = engine.prepare_prompt(request, GREEDY)
    media = replace(prepared.media, image_digests=digests)
    return replace(prepared, media=media.located(prepared.prompt_ids, engine.model.config))


def test_preempted_prompts_sharing_text_before_their_images_are_computed_again_after_it():
    """Qwen2.5-VL prompts sharing a system prompt before their images, in a pool too small for all of them: preempted,
    each is computed again from the prefix cache's blocks of that text on (its images and M-RoPE positions after it;
    transformers 5.17: from its first token) — transformers' tokens on each alone, every block given back."""
    from tests.hf.vlm_models import served_case

    case = served_case("qwen2_5_vl")
    system = list(range(60, 88))
    prompts = [[*system, image(40, 40, 1), 10, 11], [*system, image(30, 50, 2), 12], [*system, image(60, 30, 3), 13]]
    requests, expected = map(list, zip(*(_processed(case, prompt, max_new_tokens=24) for prompt in prompts)))
    engine = hfaccel.Engine(case_model(case), max_num_seqs=3, num_blocks=14, block_size=8)  # 112 slots for 3 x 60
    params = hfaccel.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert outputs[-1].metrics.num_cached_tokens == (24 if compat.continues_multimodal_prompts(case_model(case)) else 0)
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "gemma3", "llama4"])
def test_one_steps_images_are_encoded_together(name):
    """Image prompts admitted in one step have their images encoded in one call of the vision tower (LLaVA, Gemma 3:
    images of one size; Qwen2.5-VL: patches of images of several sizes), each prompt then given its rows of the
    features — its
    tokens transformers' on it alone; the third prompt's image is the first's, encoded once. transformers 5.17, whose
    forward encodes its own pixels: each prompt alone."""
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    prompts = [
        [9, image(40, 40, 1), 10, 11],
        [12, image(30, 50, 2), 13, image(60, 30, 3)],
        [14, image(40, 40, 1)],
        [15, 16, image(32, 32, 4), 17],
    ]
    requests, expected = zip(*(_processed(case, prompt) for prompt in prompts))
    engine = hfaccel.Engine(case_model(case), max_num_seqs=4, max_num_batched_tokens=512, num_blocks=64)
    outputs = engine.generate(list(requests), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == list(expected)
    cache = engine.encoder_cache
    if compat.takes_encoded_media(case_model(case)):
        assert (cache.batches, cache.misses, cache.hits) == (1, 3, 1)
    else:
        assert cache.batches == 0


@pytest.mark.parametrize("name", ["qwen3_vl", "mistral3", "smolvlm"])
def test_image_and_text_requests_equal_each_alone_after_preemption(name):
    """Qwen3-VL, Mistral 3 and SmolVLM: two image prompts and a text prompt in one batch, in a pool that holds one of
    them whole and not all three (preempted, each is computed again, with its images): transformers' tokens on each
    alone, every block given back."""
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    model = case_model(case)
    requests, expected = map(
        list, zip(*(_processed(case, p, 24) for p in [[9, image(40, 40, 1), 10], [image(30, 50, 2)]]))
    )
    text = [20, 21, 22, 23, 24]
    alone = model.generate(torch.tensor([text]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    requests.append(text)
    expected.append(alone[0, len(text) :].tolist())
    blocks = [-(-(len(r["prompt_token_ids"]) + 24) // 8) for r in requests[:2]] + [-(-(len(text) + 24) // 8)]
    engine = hfaccel.Engine(model, max_num_seqs=3, num_blocks=max(blocks) + 1, block_size=8)
    assert sum(blocks) > max(blocks) + 1
    outputs = engine.generate(requests, hfaccel.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl"])
def test_each_image_encoded_alone_gives_its_rows_of_the_prompts_encoding(name):
    """The encoder cache keeps each image of a prompt on its own: its processor inputs split by image (Qwen: the
    flattened patches by each image's grid), each encoded alone and the outputs joined in order, give the rows of the
    prompt's images encoded together (Qwen3-VL's deepstack features too); an image whose run of placeholders is not
    the rows it takes turns that off, the prompt's images encoded as one."""
    from hfaccel.runner.multimodal import PIXEL_INPUTS, EncoderCache, _per_image
    from tests.hf.vlm_models import served_case

    case = served_case(name)
    model = case_model(case)
    if not compat.takes_encoded_media(model):
        pytest.skip("the installed transformers takes no encoded images (5.17)")
    inputs = case.inputs([[9, image(40, 40, 1), 10, 11, image(30, 50, 2), 12]])
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    media = {k: v for k, v in inputs.items() if not k.endswith("token_type_ids")}
    whole = compat.encode_media(model, media)["image"]
    parts = _per_image(media, 2)
    assert parts is not None and all(part["pixel_values"].shape[0] < media["pixel_values"].shape[0] for part in parts)
    joined = compat.join_encoded_media([compat.encode_media(model, part)["image"] for part in parts])
    for field in ("pooler_output", "deepstack_features"):
        if whole.get(field) is not None:
            torch.testing.assert_close(_flat(joined[field]), _flat(whole[field]), rtol=1e-5, atol=1e-5)
    placeholder = model.config.image_token_id
    runs = [i for i, token in enumerate(ids) if token == placeholder]
    first_end = next(i for i in range(1, len(runs)) if runs[i] != runs[i - 1] + 1)
    units = ((runs[0], runs[first_end - 1] + 1, "a"), (runs[first_end], runs[-1] + 1, "b"))
    cache = EncoderCache()
    [encoded] = cache.inputs(model, [("ab", inputs, ids, units)])
    assert cache.per_image and cache.misses == 2 and not PIXEL_INPUTS & set(encoded)
    given = encoded["mm_encoder_outputs"]["image"]["pooler_output"]
    torch.testing.assert_close(_flat(given), _flat(whole["pooler_output"]), rtol=1e-5, atol=1e-5)
    wrong = ((units[0][0], units[0][1] - 1, "c"), (units[1][0], units[1][1], "d"))  # a run one token short
    cache.inputs(model, [("cd", inputs, ids, wrong)])
    assert not cache.per_image


def _flat(features) -> torch.Tensor:
    """Encoder features (a tensor, a list of them, or deepstack's list of layers of them) as rows ``[N, hidden]``."""
    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1])
    return torch.cat([_flat(feature) for feature in features])
