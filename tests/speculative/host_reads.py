"""Counting what makes the host wait for the device on CUDA: reads of tensor values, and blocking uploads.

On the CPU a device tensor is a CPU tensor and nothing waits, so :class:`HostReads` counts the calls that would wait
on CUDA. Reads: the op every scalar conversion runs (``item``, ``int``, ``float``, ``bool``, ``if tensor``:
``aten._local_scalar_dense``), the ops whose output size depends on values (``nonzero``, ``equal``, indexing by a
boolean mask), and the methods
that copy values into Python or host memory (``tolist``, ``numpy``, ``cpu``). Blocking uploads: host values put on a
device from pageable memory, which waits for the device's queue — ``torch.tensor(values, device=...)``, the same by
``torch.as_tensor`` and indexing a tensor with a Python list (``hfaccel.device.to_device``, a non-blocking copy from
pinned memory, is neither).

Code that works on host tensors by design (:func:`host_side`) is not counted: its reads never wait for the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero")
READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_host_side = [0]  # depth of host_side calls running now


class _ReadOps(TorchDispatchMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _host_side[0] and (str(func).startswith(READ_OPS) or _selects_by_mask(func, args)):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _selects_by_mask(func, args) -> bool:
    """Indexing by a boolean mask (``t[mask]``, ``t[mask] = x``): its size is the mask's count, which the host reads
    (a ``nonzero`` inside the op, where a dispatch mode does not see it)."""
    if func not in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


class HostReads(TorchFunctionMode):
    """``with HostReads() as waits:``: ``waits.reads`` and ``waits.uploads`` name each host read and blocking upload
    made inside, in order."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.uploads: list[str] = []
        self._ops = _ReadOps(self.reads)

    def __enter__(self) -> HostReads:
        super().__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ops.__exit__(*exc)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _host_side[0]:
            if func in READ_METHODS:
                self.reads.append(f"Tensor.{func.__name__}")
            elif func is torch.tensor and kwargs.get("device") is not None:
                self.uploads.append("torch.tensor(device=...)")
            elif func is torch.as_tensor and kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor):
                self.uploads.append("torch.as_tensor(host values, device=...)")
            elif func in INDEXING and _has_list(args[1]):
                self.uploads.append(f"Tensor.{func.__name__} with a list")
        return func(*args, **kwargs)


def _has_list(index) -> bool:
    return isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def host_side(function: Callable) -> Callable:
    """``function`` (which works on host tensors by design), its reads not counted."""

    @functools.wraps(function)
    def uncounted(*args, **kwargs):
        _host_side[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            _host_side[0] -= 1

    return uncounted


def counting(function: Callable, counts: list[HostReads]) -> Callable:
    """``function`` wrapped so that each call runs inside its own :class:`HostReads`, appended to ``counts``."""

    @functools.wraps(function)
    def counted(*args, **kwargs):
        with HostReads() as waits:
            counts.append(waits)
            return function(*args, **kwargs)

    return counted
