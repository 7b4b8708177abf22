"""Weight quantization: int4 (``Int4Linear``, AWQ/GPTQ checkpoints, RTN/AWQ/GPTQ quantizers) and fp8
(``Fp8Linear``)."""

from __future__ import annotations

from rich.progress import Progress
from torch import nn

from hfaccel.quant.calibrate import calibrate
from hfaccel.quant.checkpoint import load_quantized, save_quantized
from hfaccel.quant.formats import Int4Weight
from hfaccel.quant.fp8 import Fp8Linear, fp8_targets
from hfaccel.quant.linear import Int4Linear
from hfaccel.quant.rtn import quantize_rtn

METHODS = ("rtn", "awq", "gptq", "fp8")

__all__ = [
    "Fp8Linear",
    "Int4Linear",
    "Int4Weight",
    "METHODS",
    "load_quantized",
    "quantize",
    "quantize_rtn",
    "replace_module",
    "rtn_targets",
    "save_quantized",
]


def quantize(
    model: nn.Module,
    method: str = "rtn",
    *,
    calib_data=None,
    group_size: int = 128,
    act_order: bool = False,
    calib_device=None,
    skip: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """Replace the model's Linear layers (except ``skip``) by :class:`Int4Linear` — or, ``method="fp8"``, by
    :class:`Fp8Linear` — in place; returns the model.

    ``method``: ``"rtn"`` (round to nearest, no calibration data), ``"awq"`` or ``"gptq"`` (calibrated on
    ``calib_data``: token ids ``[num_samples, seq_len]``, run layer by layer, each layer on ``calib_device``
    if given; ``act_order`` for GPTQ). Layers whose shapes the int4 kernels cannot take (in_features not a
    multiple of ``group_size``, out_features not a multiple of 8) stay in full precision, with a warning.
    ``"fp8"``: float8 e4m3 weights with one scale per output channel (every Linear layer but ``skip``; no
    calibration, ``group_size`` unused).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if method == "fp8":
        return _quantize_fp8(model, skip)
    if method != "rtn":
        return calibrate(
            model,
            method,
            _calibration_ids(calib_data, method),
            group_size,
            act_order=act_order,
            calib_device=calib_device,
            skip=skip,
        )
    targets = rtn_targets(model, group_size, skip)
    with Progress(transient=True) as progress:
        task = progress.add_task(f"int4 {method} quantization", total=len(targets))
        for name, linear in targets:
            weight = quantize_rtn(linear.weight, group_size)
            replace_module(model, name, Int4Linear.from_weight(weight, linear.bias, dtype=linear.weight.dtype))
            progress.advance(task)
    return model


def _quantize_fp8(model: nn.Module, skip: tuple[str, ...]) -> nn.Module:
    for name, linear in fp8_targets(model, skip):
        replace_module(model, name, Fp8Linear.from_linear(linear))
    return model


def rtn_targets(model: nn.Module, group_size: int, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of the Linear layers :func:`quantize` turns into :class:`Int4Linear`: all but ``skip`` whose
    shapes the int4 kernels take (in_features a multiple of ``group_size``, out_features of 8; the shapes
    ``in_features`` / ``out_features`` say, the whole layer's also when tensor parallelism shards it)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear  # not bitsandbytes' subclasses
        and not any(name == s or name.endswith("." + s) for s in skip)
        and m.in_features % group_size == 0
        and m.out_features % 8 == 0
    ]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where the submodule ``name`` was."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _calibration_ids(calib_data, method: str):
    import torch

    if calib_data is None:
        raise ValueError(f"method={method!r} needs calib_data: token ids [num_samples, seq_len]")
    if isinstance(calib_data, (list, tuple)):
        lengths = {len(sample) for sample in calib_data}
        if len(lengths) != 1:
            raise ValueError(f"calib_data samples must have one length; got lengths {sorted(lengths)}")
        calib_data = torch.stack([torch.as_tensor(sample) for sample in calib_data])
    if not isinstance(calib_data, torch.Tensor) or calib_data.dim() != 2 or calib_data.is_floating_point():
        raise ValueError(
            "calib_data must be integer token ids of shape [num_samples, seq_len]; got "
            f"{type(calib_data).__name__} {getattr(calib_data, 'shape', '')}"
        )
    return calib_data
