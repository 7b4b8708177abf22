"""Putting a model on hfaccel's attention: the names it is registered under, which models it can serve."""

from __future__ import annotations

from contextlib import contextmanager

from transformers import PreTrainedModel

from hfaccel import compat
from hfaccel.attention.functions import ATTENTION_FUNCTIONS, MASK_FUNCTIONS, PATHS_ATTRIBUTE, AttentionPaths

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
    """Switch this model instance to hfaccel's attention (``ValueError`` naming the reason if it cannot serve)."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot run on hfaccel's paged attention: {reason}")
    register()
    model.set_attn_implementation(ATTENTION_NAMES[backend])


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
    current = compat.attn_implementation(model.config)
    set_hfaccel_attention(model, backend)
    try:
        yield model
    finally:
        model.set_attn_implementation(current)


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why hfaccel's attention cannot be put on this model at all, or None (``hfaccel.runner.support`` then checks
    what its layers cache and runs a trial)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (hfaccel serves decoder-only causal LMs)"
    if config.get_text_config(decoder=True) is not config:
        return f"composite (multimodal) models are not supported yet (sub-configs: {sorted(config.sub_configs)})"
    if not compat.can_set_attn_implementation(model):
        return "its modeling code does not dispatch attention through transformers' AttentionInterface"
    return None
