"""The device the suite runs models and kernels on: CPU (Triton interpreter) unless HFACCEL_TEST_DEVICE says
otherwise, e.g. ``HFACCEL_TEST_DEVICE=cuda`` on a GPU machine to run the kernels compiled."""

import os

import torch

DEVICE = torch.device(os.environ.get("HFACCEL_TEST_DEVICE", "cpu"))


def on_device(fn, *args, **kwargs):
    """Call ``fn`` with its tensor arguments moved to DEVICE; tensor results come back to the CPU."""
    move = lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v  # noqa: E731
    out = fn(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
    return out.cpu() if isinstance(out, torch.Tensor) else out
