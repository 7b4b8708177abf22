"""Which models hfaccel's attention can serve, where a model lives, and host lists as device tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from hfaccel import compat
from hfaccel.kernels.flash_attention import MAX_HEAD_DIM


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why hfaccel cannot serve this model's attention, or None when it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (hfaccel serves decoder-only causal LMs)"
    if getattr(config, "sub_configs", None):
        return f"composite (multimodal) models are not supported yet (sub-configs: {sorted(config.sub_configs)})"
    if not compat.can_set_attn_implementation(model):
        return "its modeling code does not dispatch attention through transformers' AttentionInterface"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks (s_aux) are not implemented by hfaccel's kernels"
    head_dim = _head_dim(config)
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is larger than the kernels' maximum {MAX_HEAD_DIM}"
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != head_dim:
        return f"query/key head_dim ({head_dim}) differs from value head_dim ({v_head_dim})"
    return None


def model_device(model: PreTrainedModel) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a CPU tensor) as a tensor on ``device``, without waiting for the work queued there
    (a blocking host-to-device copy would synchronize the stream: the engine must not, between steps). On CUDA
    they are staged in pinned memory, which the caching host allocator keeps until the copy is done."""
    pin = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        host = host.pin_memory() if pin else host
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    return host.to(device, non_blocking=True)


def _head_dim(config) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim
