"""Which path a kernel call takes: the Triton kernel (compiled or interpreted) or the torch reference."""

from __future__ import annotations

import os
from typing import Literal

import torch

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
