"""Tiny random image-text-to-text models of the families users serve, and prompts with generated images, built with
no download: each family's config at test sizes, its own (PIL) image processor, and the token layout its processor
writes for an image (placeholders, begin / end / break tokens, token types).

A prompt is a list of segments — token ids and ``PIL.Image`` images; :meth:`VlmCase.inputs` turns a batch of prompts
into ``generate``'s inputs, left-padded as a processor pads them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

VOCAB = 320
PAD, BOS, EOS = 0, 1, 2
IMAGE, IMAGE_START, IMAGE_END, IMAGE_BREAK = 300, 301, 302, 303  # placeholder, begin / end of image, row break
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


def image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A random RGB image."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@dataclass
class VlmCase:
    """One family: ``build()`` makes the model; ``process(images)`` its image processor's outputs for images in
    prompt order, ``tokens(pixels, i)`` the tokens that stand for image ``i`` in the text; ``per_row``: the
    processor batches pixel values per prompt (Idefics3's ``[B, images, 3, H, W]``); ``token_types``: the name of
    the token-type input marking image tokens (1), if the family takes one."""

    name: str
    build: Callable[[], transformers.PreTrainedModel]
    process: Callable[[list[Image.Image]], dict]
    tokens: Callable[[dict, int], list[int]]
    token_types: str | None = None
    per_row: bool = False

    def model(self, seed: int = 0) -> transformers.PreTrainedModel:
        torch.manual_seed(seed)
        return self.build().eval()

    def inputs(self, prompts: Sequence[Sequence[int | Image.Image]]) -> dict[str, torch.Tensor]:
        """``generate`` inputs of a batch of prompts (token ids and images), left-padded."""
        images = [part for prompt in prompts for part in prompt if isinstance(part, Image.Image)]
        pixels = self._pixels(prompts, images)
        rows, index = [], 0
        for prompt in prompts:
            row = []
            for part in prompt:
                if isinstance(part, Image.Image):
                    row += self.tokens(pixels, index)
                    index += 1
                else:
                    row.append(part)
            rows.append(row)
        width = max(map(len, rows))
        ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
        inputs = {
            "input_ids": ids,
            "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows]),
        }
        if self.token_types is not None:
            inputs[self.token_types] = (ids == IMAGE).long()
        return {**inputs, **{name: value for name, value in pixels.items() if name != "tokens"}}

    def _pixels(self, prompts, images: list[Image.Image]) -> dict:
        if not images:
            return {}
        if not self.per_row:
            return self.process(images)
        per_prompt = [[part for part in prompt if isinstance(part, Image.Image)] for prompt in prompts]
        return self.process(per_prompt)


def _qwen_tokens(merge: int) -> Callable[[dict, int], list[int]]:
    def tokens(pixels: dict, i: int) -> list[int]:
        return [IMAGE_START] + [IMAGE] * (int(pixels["image_grid_thw"][i].prod()) // merge**2) + [IMAGE_END]

    return tokens


def _qwen_processor(patch: int, merge: int):
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, min_pixels=(patch * merge) ** 2 * 4, max_pixels=(patch * merge) ** 2 * 24
    )
    return lambda images: dict(processor(images=images, return_tensors="pt"))


def _qwen2_5_vl() -> transformers.PreTrainedModel:
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 20.0}}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=304,
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_vl() -> transformers.PreTrainedModel:
    text = {
        **TEXT,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
            "rope_theta": 20.0,
        },
    }
    config = transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=IMAGE,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=304,
    )
    return transformers.Qwen3VLForConditionalGeneration(config)


def _qwen3_5() -> transformers.PreTrainedModel:
    """Qwen3.5: Qwen3-VL's vision encoder over a hybrid language model (linear-attention layers keep recurrent
    state)."""
    from tests.hf.tiny_configs import tiny_config

    text = tiny_config("qwen3_5_text", vocab_size=VOCAB).to_dict()
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=text["hidden_size"],
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
        ),
        image_token_id=IMAGE,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=304,
    )
    return transformers.Qwen3_5ForConditionalGeneration(config)


GEMMA3_IMAGE, GEMMA3_TOKENS = 28, 16  # SigLIP input side; tokens per image after pooling


def _gemma3(text: dict = TEXT, image: int = IMAGE, start: int = IMAGE_START, end: int = IMAGE_END):
    text = {
        **text,
        "num_hidden_layers": 3,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 16,
    }
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=GEMMA3_IMAGE,
            patch_size=7,
        ),
        mm_tokens_per_image=GEMMA3_TOKENS,
        image_token_index=image,
        boi_token_index=start,
        eoi_token_index=end,
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def _gemma3_processor():
    processor = transformers.Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE})
    return lambda images: {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}


def _gemma4() -> transformers.PreTrainedModel:
    """Gemma 4: its per-layer head sizes and KV-shared layers (tests/models.gemma4_config) under a tiny vision
    encoder of 4-pixel patches pooled 2x2."""
    from tests.models import gemma4_config

    config = transformers.Gemma4Config(
        text_config=gemma4_config(VOCAB).to_dict(),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=4,
            pooling_kernel_size=2,
            position_embedding_size=64,
        ),
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=IMAGE_START,
        eoi_token_id=IMAGE_END,
    )
    return transformers.Gemma4ForConditionalGeneration(config)


def _gemma4_processor():
    processor = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)

    def process(images: list[Image.Image]) -> dict:
        out = processor(images=images, return_tensors="pt")
        return {
            "pixel_values": out["pixel_values"],
            "image_position_ids": out["image_position_ids"],
            "tokens": out["num_soft_tokens_per_image"],
        }

    return process


LLAVA_IMAGE, LLAVA_PATCH = 28, 7


def _llava() -> transformers.PreTrainedModel:
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=LLAVA_IMAGE,
            patch_size=LLAVA_PATCH,
            projection_dim=32,
        ),
        image_token_index=IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return transformers.LlavaForConditionalGeneration(config)


def _llava_processor():
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE}, crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE}
    )
    return lambda images: dict(processor(images=images, return_tensors="pt"))


MISTRAL3_PATCH, MISTRAL3_MERGE = 8, 2


def _mistral3() -> transformers.PreTrainedModel:
    config = transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**TEXT),
        vision_config=transformers.PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=16,
            image_size=64,
            patch_size=MISTRAL3_PATCH,
        ),
        image_token_index=IMAGE,
        spatial_merge_size=MISTRAL3_MERGE,
        vision_feature_layer=-1,
    )
    return transformers.Mistral3ForConditionalGeneration(config)


def _mistral3_processor():
    processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": 64}, patch_size={"height": MISTRAL3_PATCH, "width": MISTRAL3_PATCH}
    )
    return lambda images: dict(processor(images=images, return_tensors="pt"))


def _mistral3_tokens(pixels: dict, i: int) -> list[int]:
    """Pixtral's layout: a row of placeholders per merged patch row, each closed by a break, the last by the end."""
    height, width = (int(side) // (MISTRAL3_PATCH * MISTRAL3_MERGE) for side in pixels["image_sizes"][i])
    rows = [[IMAGE] * width + [IMAGE_BREAK] for _ in range(height)]
    rows[-1][-1] = IMAGE_END
    return [token for row in rows for token in row]


LLAMA4_IMAGE, LLAMA4_PATCH = 28, 7
LLAMA4_TOKENS = (LLAMA4_IMAGE // LLAMA4_PATCH) ** 2 // 4  # the patches of one tile, pixel-shuffled by 0.5 per side


def _llama4() -> transformers.PreTrainedModel:
    """Llama 4 with its mixture of experts, chunked attention (chunks of 8, which prompts and answers cross) and
    no-RoPE layers, and its vision tower (2-D RoPE, pixel shuffle)."""
    text = transformers.Llama4TextConfig(
        **{**TEXT, "num_hidden_layers": 4},
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=8,
        no_rope_layers=[1, 0, 1, 0],
        layer_types=["chunked_attention", "full_attention"] * 2,
    )
    vision = transformers.Llama4VisionConfig(
        hidden_size=32,
        intermediate_size=128,  # the pixel-shuffled width (hidden_size / 0.5**2) its adapter's first layer takes
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=LLAMA4_IMAGE,
        patch_size=LLAMA4_PATCH,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
        pixel_shuffle_ratio=0.5,
    )
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=IMAGE)
    return transformers.Llama4ForConditionalGeneration(config)


def _llama4_pixels(images: list[Image.Image]) -> dict:
    """Llama4ImageProcessor's values for images of one tile (it needs torchvision, which CI's CPU torch lacks): each
    image resized to the tile, scaled to [0, 1] and normalized by mean 0.5 and std 0.5."""
    tiles = [np.asarray(im.convert("RGB").resize((LLAMA4_IMAGE, LLAMA4_IMAGE)), dtype=np.float32) for im in images]
    return {"pixel_values": (torch.tensor(np.stack(tiles)).permute(0, 3, 1, 2) / 255 - 0.5) / 0.5}


@functools.cache
def llama4_forward_fails() -> str | None:
    """Why transformers' own Llama 4 image-text forward cannot run on the installed release (5.24's builds its output
    from a field its language model's output lacks), or None."""
    torch.manual_seed(0)
    model = _llama4().eval()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6]]))
    except AttributeError as error:
        return f"transformers {transformers.__version__}'s Llama4ForConditionalGeneration.forward raises: {error}"
    return None


SMOLVLM_IMAGE, SMOLVLM_PATCH, SMOLVLM_SCALE = 32, 8, 2


def _smolvlm() -> transformers.PreTrainedModel:
    config = transformers.SmolVLMConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=SMOLVLM_IMAGE,
            patch_size=SMOLVLM_PATCH,
        ),
        image_token_id=IMAGE,
        scale_factor=SMOLVLM_SCALE,
    )
    return transformers.SmolVLMForConditionalGeneration(config)


def _smolvlm_pixels(per_prompt: list[list[Image.Image]]) -> dict:
    """What SmolVLM's processor gives without image splitting (its image processor needs torchvision under
    transformers 5.17): each image resized to one square crop, scaled to [-1, 1], ``[B, images, 3, H, W]`` padded
    with empty crops that ``pixel_attention_mask`` marks."""
    most = max(map(len, per_prompt))
    pixels = torch.zeros(len(per_prompt), most, 3, SMOLVLM_IMAGE, SMOLVLM_IMAGE)
    mask = torch.zeros(len(per_prompt), most, SMOLVLM_IMAGE, SMOLVLM_IMAGE, dtype=torch.long)
    for row, images in enumerate(per_prompt):
        for i, picture in enumerate(images):
            array = np.asarray(picture.resize((SMOLVLM_IMAGE, SMOLVLM_IMAGE)), dtype=np.float32) / 255.0
            pixels[row, i] = (torch.from_numpy(array).permute(2, 0, 1) - 0.5) / 0.5
            mask[row, i] = 1
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def _smolvlm_tokens(pixels: dict, i: int) -> list[int]:
    tokens = (SMOLVLM_IMAGE // SMOLVLM_PATCH) ** 2 // SMOLVLM_SCALE**2
    return [IMAGE_START] + [IMAGE] * tokens + [IMAGE_END]


CASES = {
    "qwen2_5_vl": VlmCase(
        "qwen2_5_vl", _qwen2_5_vl, _qwen_processor(14, 2), _qwen_tokens(2), token_types="mm_token_type_ids"
    ),
    "qwen3_vl": VlmCase(
        "qwen3_vl", _qwen3_vl, _qwen_processor(16, 2), _qwen_tokens(2), token_types="mm_token_type_ids"
    ),
    "qwen3_5": VlmCase("qwen3_5", _qwen3_5, _qwen_processor(16, 2), _qwen_tokens(2), token_types="mm_token_type_ids"),
    "gemma3": VlmCase(
        "gemma3",
        _gemma3,
        _gemma3_processor(),
        lambda pixels, i: [IMAGE_START] + [IMAGE] * GEMMA3_TOKENS + [IMAGE_END],
        token_types="token_type_ids",
    ),
    "gemma4": VlmCase(
        "gemma4",
        _gemma4,
        _gemma4_processor(),
        lambda pixels, i: [IMAGE_START] + [IMAGE] * int(pixels["tokens"][i]) + [IMAGE_END],
    ),
    "llava": VlmCase(
        "llava", _llava, _llava_processor(), lambda pixels, i: [IMAGE] * (LLAVA_IMAGE // LLAVA_PATCH) ** 2
    ),
    "mistral3": VlmCase("mistral3", _mistral3, _mistral3_processor(), _mistral3_tokens),
    "smolvlm": VlmCase("smolvlm", _smolvlm, _smolvlm_pixels, _smolvlm_tokens, per_row=True),
    "llama4": VlmCase(
        "llama4", _llama4, _llama4_pixels, lambda pixels, i: [IMAGE_START] + [IMAGE] * LLAMA4_TOKENS + [IMAGE_END]
    ),
}


def served_case(name: str) -> VlmCase:
    """``CASES[name]`` — or the calling test skipped where transformers' own forward of that family cannot run on the
    installed release: there are no tokens of transformers' to compare with."""
    if name == "llama4" and (reason := llama4_forward_fails()) is not None:
        pytest.skip(reason)
    return CASES[name]


def chat_template(placeholder: str) -> str:
    """A plain chat template in which each image content part becomes the processor's ``placeholder``."""
    return (
        "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
        "{% for c in m.content %}{% if c.type == 'image' %}" + placeholder + "{% else %}{{ c.text }}{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )


def _text_over(tokenizer) -> dict:
    """The test models' text config over a real tokenizer's vocabulary and special tokens."""
    return {
        **TEXT,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id or 0,
    }


def llava_with_processor(seed: int = 0) -> tuple[transformers.PreTrainedModel, transformers.ProcessorMixin]:
    """A tiny random LLaVA over SmolLM2's real tokenizer (``<image>`` added) and its real processor, as
    ``AutoProcessor`` would load one: what pipelines, the Engine and the server take."""
    from tests.assets import smollm2_or_skip

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_or_skip())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_IMAGE}, crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chat_template("<image>"),
    )
    text = transformers.LlamaConfig(**_text_over(tokenizer))
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=LLAVA_IMAGE,
            patch_size=LLAVA_PATCH,
            projection_dim=32,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(config).eval(), processor


def gemma3_with_processor(seed: int = 0) -> tuple[transformers.PreTrainedModel, transformers.ProcessorMixin]:
    """A tiny random Gemma 3 over SmolLM2's real tokenizer (Gemma 3's image tokens added) and its real processor
    (each image ``<start_of_image>``, its soft tokens, ``<end_of_image>``; bidirectional attention over them)."""
    from tests.assets import smollm2_or_skip

    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_or_skip(), extra_special_tokens=names)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE}),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_TOKENS,
        chat_template=chat_template("<start_of_image>"),
    )
    ids = tokenizer.convert_tokens_to_ids([names["image_token"], names["boi_token"], names["eoi_token"]])
    torch.manual_seed(seed)
    return _gemma3(_text_over(tokenizer), *ids).eval(), processor
