"""Putting a model on hfaccel's attention: the names it is registered under, which models it can serve."""

from __future__ import annotations

from contextlib import contextmanager

from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from hfaccel import compat
from hfaccel.attention.functions import ATTENTION_FUNCTIONS, MASK_FUNCTIONS
from hfaccel.attention.paths import PATHS_ATTRIBUTE, AttentionPaths

# hfaccel's attention implementations, by kernel backend
ATTENTION_NAMES: dict[str, str] = {"auto": "hfaccel", "triton": "hfaccel_triton", "torch": "hfaccel_torch"}


def register() -> None:
    """Register hfaccel's attention and mask functions under hfaccel's own names (idempotent)."""
    for backend, name in ATTENTION_NAMES.items():
        compat.register_attention(name, ATTENTION_FUNCTIONS[backend], MASK_FUNCTIONS[backend])


def uses_hfaccel_attention(model: PreTrainedModel) -> bool:
    """Whether the model's attention implementation is one of hfaccel's."""
    return compat.attn_implementation(model.config) in ATTENTION_NAMES.values()


def set_hfaccel_attention(model: PreTrainedModel, backend: str = "auto") -> None:
    """Switch this model instance to hfaccel's attention (``ValueError`` naming the reason if it cannot serve). A
    multimodal model's language model switches; its vision (or audio) encoders keep their own attention."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot run on hfaccel's paged attention: {reason}")
    register()
    name = ATTENTION_NAMES[backend]
    text_key = text_config_key(model.config)
    model.set_attn_implementation(name if text_key is None else {"": name, text_key: name})


def attention_implementations(model: PreTrainedModel) -> str | dict[str, str]:
    """What ``model.set_attn_implementation`` takes to put the model's current attention back: its implementation,
    or for a multimodal model the top config's and each sub-config's."""
    config = model.config
    if not config.sub_configs:
        return compat.attn_implementation(config)
    subs = {
        key: compat.attn_implementation(getattr(config, key))
        for key in config.sub_configs
        if getattr(config, key, None) is not None
    }
    return {"": compat.attn_implementation(config), **subs}


def text_config_key(config) -> str | None:
    """The sub-config key of a multimodal model's language model (``"text_config"``), or None for a text-only
    model."""
    text = config.get_text_config(decoder=True)
    if text is config:
        return None
    return next(key for key in config.sub_configs if getattr(config, key, None) is text)


def track_paths(model: PreTrainedModel) -> AttentionPaths:
    """Count which path serves the model's attention calls from now on: one :class:`AttentionPaths` shared by its
    attention modules (the modules that own a KV-cache layer: they carry ``layer_idx``)."""
    paths = AttentionPaths()
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            setattr(module, PATHS_ATTRIBUTE, paths)
    return paths


def untrack_paths(model: PreTrainedModel) -> None:
    """Stop counting (undoes :func:`track_paths`)."""
    for module in model.modules():
        if PATHS_ATTRIBUTE in vars(module):
            delattr(module, PATHS_ATTRIBUTE)


@contextmanager
def hfaccel_attention(model: PreTrainedModel, backend: str = "auto"):
    """Run ``model`` with hfaccel's attention for the duration of the block (a no-op if it already does).

    A model that hfaccel cannot serve raises ``ValueError`` saying why. The model's own attention
    implementation is put back on exit.
    """
    if uses_hfaccel_attention(model):
        yield model
        return
    current = attention_implementations(model)
    set_hfaccel_attention(model, backend)
    try:
        yield model
    finally:
        model.set_attn_implementation(current)


def is_image_text_to_text(model: PreTrainedModel) -> bool:
    """Whether ``model`` is one of transformers' image-text-to-text models (a vision encoder feeding a causal
    language model: ``AutoModelForImageTextToText``)."""
    return type(model).__name__ in set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why hfaccel's attention cannot be put on this model at all, or None (``hfaccel.runner.support`` then checks
    what its layers cache and runs a trial)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (hfaccel serves decoder-only causal LMs)"
    text = config.get_text_config(decoder=True)
    if text is not config and not is_image_text_to_text(model):
        return (
            f"multimodal models other than image-text-to-text ones are not supported yet (sub-configs: "
            f"{sorted(config.sub_configs)})"
        )
    if text is not config and text_config_key(config) is None:
        return "its language model's config is not one of its sub-configs"
    if not compat.can_set_attn_implementation(model):
        return "its modeling code does not dispatch attention through transformers' AttentionInterface"
    return None
