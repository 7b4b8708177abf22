"""``Int4Linear``: an ``nn.Linear`` replacement holding int4 weights, running the W4A16 kernels (on a CPU, torch's
int4 CPU kernel)."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn

from hfaccel.kernels.ops import w4a16_matmul_op
from hfaccel.kernels.w4a16 import Int4Pack, int4pack_device, int4pack_matmul, int4pack_unsupported, pack_int4_cpu
from hfaccel.quant.formats import Int4Weight


class Int4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as 4-bit integers, per-group scales and zero points.

    Buffers (hfaccel's kernel layout, see ``hfaccel.kernels.w4a16``): ``qweight [K/8, N]`` int32,
    ``scales`` and ``zeros [K/group_size, N]`` in the activation dtype, and for activation-order (GPTQ
    ``desc_act``) checkpoints ``perm [K]`` (the input permutation that makes groups contiguous) and ``g_idx``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int = 128,
        bias: bool = False,
        act_order: bool = False,
        dtype: torch.dtype = torch.float16,
        device=None,
    ):
        super().__init__()
        if in_features % group_size or group_size % 8 or out_features % 8:
            raise ValueError(
                f"Int4Linear needs in_features ({in_features}) divisible by group_size "
                f"({group_size}), group_size by 8 and out_features ({out_features}) by 8"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features // 8, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.zeros(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("perm", torch.arange(in_features, device=device) if act_order else None)
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self._int4pack: Int4Pack | None = None
        self.cpu_path: str | None = None  # decided by the first CPU forward (or cpu_pack())

    @classmethod
    def from_weight(
        cls, weight: Int4Weight, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
    ) -> Int4Linear:
        """Wrap an :class:`Int4Weight` (and an optional bias) as a module."""
        k, n = weight.qweight.shape[0] * 8, weight.qweight.shape[1]
        dtype = dtype or weight.scales.dtype
        module = cls(
            k,
            n,
            group_size=weight.group_size,
            bias=bias is not None,
            act_order=weight.perm is not None,
            dtype=dtype,
            device=weight.qweight.device,
        )
        module.qweight.copy_(weight.qweight)
        module.scales.copy_(weight.scales.to(dtype))
        module.zeros.copy_(weight.zeros.to(dtype))
        if weight.perm is not None:
            module.perm.copy_(weight.perm)
            module.g_idx.copy_(weight.g_idx)
        if bias is not None:
            module.bias.data.copy_(bias.to(dtype))
        return module

    def int4_weight(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size, self.perm, self.g_idx)

    def cpu_pack(self) -> Int4Pack | None:
        """The weight repacked for torch's CPU int4 kernel, built on the first call (outside ``torch.compile``,
        which uses what eager calls built), or None where the kernel cannot take it (:attr:`cpu_path` says why;
        a warning too)."""
        if self.cpu_path is None and not torch.compiler.is_compiling():
            reason = int4pack_unsupported(self.group_size)
            if reason is None:
                self._int4pack = pack_int4_cpu(self.qweight, self.scales, self.zeros, self.group_size)
                self.cpu_path = "int4pack (aten._weight_int4pack_mm_for_cpu, bf16)"
            else:
                self.cpu_path = f"torch reference ({reason})"
                warnings.warn(f"Int4Linear on a CPU runs the slow torch reference: {reason}", stacklevel=2)
        return self._int4pack

    @property
    def path(self) -> str:
        """What serves this layer's forward on its present device."""
        if int4pack_device(self.qweight.device):
            return self.cpu_path or "int4pack (packed on the first CPU forward)"
        return "W4A16 kernels"

    def _drop_cpu_pack(self) -> None:
        self._int4pack, self.cpu_path = None, None

    def _apply(self, fn, recurse: bool = True):
        self._drop_cpu_pack()  # moved or cast: the pack would be stale (or on the wrong device)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._drop_cpu_pack()
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias: ``[..., K] -> [..., N]``."""
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        pack = self.cpu_pack() if int4pack_device(flat.device) else None
        if pack is not None:
            out = int4pack_matmul(flat, pack)
        else:
            out = w4a16_matmul_op(flat, self.qweight, self.scales, self.zeros, self.group_size, "auto")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits=4, "
            f"group_size={self.group_size}, act_order={self.perm is not None}, bias={self.bias is not None}"
            + (f", cpu_path={self.cpu_path}" if self.cpu_path else "")
        )


def int4_layers(model: nn.Module) -> tuple[Int4Linear, ...]:
    """The :class:`Int4Linear` layers of ``model``, in module order."""
    return tuple(m for m in model.modules() if isinstance(m, Int4Linear))


def prepare_int4(layers: tuple[Int4Linear, ...]) -> None:
    """Repack each layer for torch's CPU int4 kernel now where it will serve (so a compiled first forward finds
    the pack; a no-op elsewhere)."""
    for layer in layers:
        if int4pack_device(layer.qweight.device):
            layer.cpu_pack()


def int4_paths(layers: tuple[Int4Linear, ...]) -> str:
    """``"30 × int4pack (...)"``-style summary of what serves ``layers``."""
    counts = Counter(layer.path for layer in layers)
    return ", ".join(f"{n} × {path}" for path, n in counts.items())
