"""hfaccel's attention for transformers models: the attention and mask functions, and how a model gets them."""

from hfaccel.attention.functions import ATTENTION_FUNCTIONS
from hfaccel.attention.masks import KernelMask, kernel_mask
from hfaccel.attention.paths import AttentionPaths
from hfaccel.attention.sdpa import prefill_route
from hfaccel.attention.install import (
    ATTENTION_NAMES,
    attention_implementations,
    hfaccel_attention,
    is_image_text_to_text,
    register,
    set_hfaccel_attention,
    text_config_key,
    track_paths,
    unsupported_reason,
    untrack_paths,
    uses_hfaccel_attention,
)

__all__ = [
    "ATTENTION_FUNCTIONS",
    "ATTENTION_NAMES",
    "AttentionPaths",
    "KernelMask",
    "attention_implementations",
    "hfaccel_attention",
    "is_image_text_to_text",
    "kernel_mask",
    "prefill_route",
    "register",
    "set_hfaccel_attention",
    "text_config_key",
    "track_paths",
    "unsupported_reason",
    "untrack_paths",
    "uses_hfaccel_attention",
]
