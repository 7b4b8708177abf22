"""Which path a kernel call takes: the Triton kernel (compiled or interpreted) or the torch reference; what the
installed Triton and the device offer (TMA descriptors, SM count)."""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors (triton >= 3.3)

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run(device: torch.device | str) -> bool:
    """Whether a Triton kernel can be launched on tensors of ``device`` in this process."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


def resolve_backend(backend: str, device: torch.device | str) -> Literal["triton", "torch"]:
    """Turn a requested backend into the one a call on ``device`` will use.

    ``auto`` picks Triton wherever it can run and the torch reference elsewhere; ``triton`` raises a
    ``ValueError`` where Triton cannot run instead of silently taking another path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if triton_can_run(device):
        return "triton"
    if backend == "triton":
        raise ValueError(
            f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors); "
            f"got tensors on {torch.device(device)}. Use backend='auto' or 'torch' to run the torch reference."
        )
    return "torch"


def tma_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can read through TMA tensor descriptors: a Hopper-or-newer GPU (or the
    interpreter, which emulates them)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu" and interpreting()


def tma_descriptor(t: torch.Tensor, block_shape: list[int]):
    """A TMA descriptor of ``t`` (its own shape and strides) read in ``block_shape`` boxes — reads past the
    tensor's ends return zeros — or None where TMA cannot read ``t``: its last dim not contiguous, its base or a
    stride not 16-byte aligned, or an empty dim."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16 or 0 in t.shape or any(stride * size % 16 for stride in t.stride()[:-1]):
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape))


DEFAULT_NUM_SMS = 132  # an H100 SXM: what launches sized for the GPU assume off CUDA (the interpreter)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device); :data:`DEFAULT_NUM_SMS` elsewhere (the
    CPU, None, or a CUDA device named where no GPU is present: the heuristics' reference GPU)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_NUM_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
