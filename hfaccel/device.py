"""Where a model lives, and host values as device tensors without waiting for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def model_device(model: torch.nn.Module) -> torch.device:
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
