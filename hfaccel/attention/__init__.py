"""hfaccel's attention for transformers models: the attention and mask functions, and how a model gets them."""

from hfaccel.attention.functions import ATTENTION_FUNCTIONS, KernelMask, kernel_mask
from hfaccel.attention.install import (
    ATTENTION_NAMES, hfaccel_attention, register, set_hfaccel_attention, unsupported_reason, uses_hfaccel_attention,
)

__all__ = ["ATTENTION_FUNCTIONS", "ATTENTION_NAMES", "KernelMask", "hfaccel_attention", "kernel_mask", "register",
           "set_hfaccel_attention", "unsupported_reason", "uses_hfaccel_attention"]
