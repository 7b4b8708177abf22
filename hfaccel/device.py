"""Where a model lives, what was worked out about it there, host values as device tensors without waiting for the
device, and whether a device that raised still runs anything."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def per_model(memo: weakref.WeakKeyDictionary, model: torch.nn.Module, compute: Callable[[torch.nn.Module], T]) -> T:
    """``compute(model)``, worked out once per model, dtype and device: ``memo`` (a module's, weakly keyed) keeps the
    answer while the model lives, and a model moved or cast is worked out again."""
    key = (getattr(model, "dtype", None), model_device(model))
    known = memo.get(model)
    if known is None or known[0] != key:
        memo[model] = known = (key, compute(model))
    return known[1]


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


class DeviceLostError(BaseException):
    """The device raised an error it keeps (a CUDA error that sticks to its context: an illegal memory access, a
    device-side assert): every later call on it fails alike, so nothing more runs in this process, which must be
    restarted. A ``BaseException``, as ``SystemExit`` is, so that the engine's handlers that fail one step's requests
    and go on serving (``except Exception``) let it through: it ends ``AsyncEngine``'s thread (``healthy`` turns
    False) and ``hfaccel serve`` exits with status 1."""


def raise_if_lost(error: BaseException, device: torch.device) -> None:
    """Raise :class:`DeviceLostError` from ``error`` when ``device`` no longer runs anything; return otherwise (an
    error the device recovers from: out of memory, a bad launch, a bad input). Any error is asked about: torch
    raises ``torch.AcceleratorError``, Triton's launcher a plain ``RuntimeError``."""
    if not device_works(device):
        raise DeviceLostError(
            f"{device} raised {error} and fails every call since (the error stays with its context); nothing more "
            "can run in this process: restart it"
        ) from error


def device_works(device: torch.device) -> bool:
    """Whether ``device`` still runs work: a CUDA context that kept an error returns it from every call, so asking
    whether its stream is done raises it. Waits for nothing (a tensor-parallel rank may have a collective in flight
    that waits for a peer). Other devices have no such context here: True."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.current_stream(device).query()
    except Exception:
        return False
    return True
