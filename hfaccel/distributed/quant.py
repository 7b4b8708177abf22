"""int4 (RTN) and fp8 weights under tensor parallelism: each rank quantizes its own shard of each Linear, so the
ranks together hold exactly the quantized weights one process would.

RTN quantizes each output column of ``W [N, K]`` in groups of ``group_size`` along K. A colwise layer's shard
``[N/tp, K]`` is whole rows of ``W``: its int4 weights are those rows' of the whole layer. A rowwise layer's shard
``[N, K/tp]`` is a run of K: its groups are the whole layer's when ``K/tp`` is a multiple of ``group_size`` (else
the layer cannot be split so, a ``ValueError`` naming it). Layers one process would leave in full precision
(their shape does not fit the int4 kernels) stay so here too, with transformers' TP forward.

fp8 scales each output channel (a row of ``W``) by its largest magnitude: a colwise shard holds whole rows; a rowwise
shard's rows are parts of the whole rows, so the ranks agree on each row's largest magnitude first (an all-reduce of
the maxima) and each quantizes its part with the whole row's scale.

Replacing a Linear drops the forward transformers' TP installed on it (it replaces the module's ``forward``; a
colwise one is local, a rowwise one all-reduces its output): a colwise layer needs nothing more on the local
path hfaccel runs (input replicated, output the rank's shard); a rowwise layer becomes :class:`RowwiseInt4Linear`,
which all-reduces its partial output over the TP group before adding the bias, as transformers' rowwise forward
does (fp8: :class:`RowwiseFp8Linear`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfaccel import compat
from hfaccel.distributed.model import tensor_parallel
from hfaccel.quant import Fp8Linear, Int4Linear, quantize_rtn, replace_module, rtn_targets
from hfaccel.quant.fp8 import fp8_targets, quantize_rows, row_amax
from hfaccel.quant.formats import Int4Weight

STYLES = ("colwise", "rowwise")  # the TP styles of a Linear whose shard int4 can replace


class RowwiseInt4Linear(Int4Linear):
    """A rowwise-sharded :class:`Int4Linear`: this rank's ``K/tp`` input columns; the partial products of every
    rank summed (all-reduce over ``group``), then the bias (the whole of it, on every rank) added once."""

    group: dist.ProcessGroup | None = None

    @classmethod
    def sharded(
        cls, weight: Int4Weight, bias: torch.Tensor | None, group: dist.ProcessGroup, dtype: torch.dtype
    ) -> RowwiseInt4Linear:
        module = cls.from_weight(weight, bias, dtype=dtype)
        module.group = group
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K/tp] (this rank's columns) -> [..., N]
        out = self.matmul(x)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class RowwiseFp8Linear(Fp8Linear):
    """A rowwise-sharded :class:`Fp8Linear`: this rank's ``K/tp`` input columns (scaled by the whole rows' scales);
    the partial products of every rank summed (all-reduce over ``group``), then the bias added once."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K/tp] (this rank's columns) -> [..., N]
        out = self.matmul(x)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def quantize_shards(
    model: nn.Module, method: str = "rtn", *, group_size: int = 128, skip: tuple[str, ...] = ("lm_head",)
) -> nn.Module:
    """Replace the Linear layers of a model transformers sharded with ``tp_plan`` by int4 (``method="rtn"``) or fp8
    (``"fp8"``) layers of each rank's shard, in place (``hfaccel.quantize``'s choice of layers); returns the model. A
    layer whose shard cannot be quantized as the whole layer would be is a ``ValueError`` naming it (nothing
    changed)."""
    if method == "fp8":
        return _fp8_shards(model, skip)
    if method != "rtn":
        raise ValueError(
            f"int4 under tensor parallelism: quantize='rtn' only (awq and gptq calibrate on one "
            f"process); got {method!r}"
        )
    size = compat.tp_size(model)
    plans = [
        (name, linear, _shard_plan(model, name, linear, size, group_size))
        for name, linear in rtn_targets(model, group_size, skip)
    ]  # every check before anything changes
    tp = tensor_parallel(model)
    if tp is None:
        raise ValueError("quantize_shards: the model is not sharded by transformers' tensor parallelism")
    for name, linear, style in plans:
        weight = quantize_rtn(compat.local_tensor(linear.weight), group_size)
        bias = None if linear.bias is None else compat.local_tensor(linear.bias)
        dtype = linear.weight.dtype
        module = (
            RowwiseInt4Linear.sharded(weight, bias, tp.group, dtype)
            if style == "rowwise"
            else Int4Linear.from_weight(weight, bias, dtype=dtype)
        )
        replace_module(model, name, module)
    return model


def _fp8_shards(model: nn.Module, skip: tuple[str, ...]) -> nn.Module:
    """:func:`quantize_shards` for fp8 (module docstring): every Linear but ``skip``, per output channel."""
    tp = tensor_parallel(model)
    if tp is None:
        raise ValueError("quantize_shards: the model is not sharded by transformers' tensor parallelism")
    plans = []
    for name, linear in fp8_targets(model, skip):  # every check before anything changes
        style = compat.tp_style(model, name)
        if style not in (None, *STYLES):
            raise ValueError(
                f"fp8 under tensor parallelism: {name} is sharded {style!r}; fp8 shards only {STYLES} "
                f"Linear layers (skip it: hfaccel.quantize's skip=)"
            )
        plans.append((name, linear, style))
    for name, linear, style in plans:
        weight = compat.local_tensor(linear.weight)  # [N or N/tp, K or K/tp]
        bias = None if linear.bias is None else compat.local_tensor(linear.bias)
        amax = None
        if style == "rowwise":  # the whole rows' largest magnitudes, agreed by every rank
            amax = row_amax(weight)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
        quantized, scale = quantize_rows(weight, amax)
        cls = RowwiseFp8Linear if style == "rowwise" else Fp8Linear
        module = cls.from_checkpoint(quantized, scale, None, bias, dtype=linear.weight.dtype)
        if style == "rowwise":
            module.group = tp.group
        replace_module(model, name, module)
    return model


def _shard_plan(model: nn.Module, name: str, linear: nn.Linear, size: int, group_size: int) -> str | None:
    """The layer's TP style (None: whole on every rank), checked: its shard quantizes as the whole layer would."""
    style = compat.tp_style(model, name)
    if style is None:
        return None
    if style not in STYLES:
        raise ValueError(
            f"int4 under tensor parallelism: {name} is sharded {style!r}; int4 shards only {STYLES} "
            f"Linear layers (skip it: hfaccel.quantize's skip=)"
        )
    out_features, in_features = compat.local_tensor(linear.weight).shape
    whole = (linear.out_features, linear.in_features)
    if style == "colwise":
        fits = out_features * size == whole[0] and out_features % 8 == 0
        need = f"its out_features ({whole[0]}) split {size} ways into multiples of 8"
    else:
        fits = in_features * size == whole[1] and in_features % group_size == 0
        need = f"its in_features ({whole[1]}) split {size} ways into multiples of group_size ({group_size})"
    if not fits:
        raise ValueError(
            f"int4 under tensor parallelism: {name} ({style}, [out, in] = {list(whole)}, this rank's "
            f"shard {[out_features, in_features]}) cannot be split on int4 group boundaries: it needs "
            f"{need}. Use a group size that divides its shard, or another tensor-parallel size"
        )
    return style
