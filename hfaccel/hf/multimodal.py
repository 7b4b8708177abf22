"""A ``generate`` call with images in hfaccel's decode loop: which of its inputs are multimodal, whether the loop
serves them; the prefill itself is ``hfaccel.runner.multimodal.prefill_batch`` (transformers' own prefill into the
runner's pool), the decode steps hfaccel's."""

from __future__ import annotations

from hfaccel import compat
from hfaccel.attention import is_image_text_to_text
from hfaccel.runner.multimodal import PIXEL_INPUTS

# what a vision encoder reads, or (generate() encodes the pixels before its prefill) has made of it
ENCODER_INPUTS = PIXEL_INPUTS | {"mm_encoder_outputs"}
# generate() model inputs of a text prompt (everything else a multimodal model is given is its images' inputs)
TEXT_INPUTS = frozenset(
    {
        "attention_mask",
        "position_ids",
        "use_cache",
        "logits_to_keep",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        *compat.CACHE_ARGUMENTS,
    }
)


def multimodal_inputs(model, model_kwargs: dict) -> list[str]:
    """The names of a ``generate`` call's inputs beyond a text prompt's that hfaccel's loop takes to the multimodal
    prefill (an image-text-to-text model's pixel values, image sizes, token types...; not the empty encoder outputs
    generate() prepares for a prompt without images); empty for other models."""
    if not is_image_text_to_text(model):
        return []
    return sorted(name for name, value in model_kwargs.items() if name not in TEXT_INPUTS and given(value))


def given(value) -> bool:
    """Whether a model input holds something (not None, not the empty encoder outputs generate() prepares)."""
    return value is not None and not (isinstance(value, dict) and not value)


def carries_images(names: list[str]) -> bool:
    """Whether a call with these multimodal inputs has images (or videos) to encode; without them its token types
    or image sizes mark nothing, and the prompt is text."""
    return any(name in ENCODER_INPUTS for name in names)
