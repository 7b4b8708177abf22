"""Round-to-nearest (RTN) int4 quantization: asymmetric, per group of input columns, per output row."""

from __future__ import annotations

import torch

from hfaccel.quant.formats import Int4Weight, pack_along_rows


def group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit (scale, zero) for each column of ``w [rows, N]``: [min, max] (widened to include 0)
    mapped onto 0..15. Scales are rounded to fp16 values, what AWQ/GPTQ files store, so saving is lossless."""
    low = w.amin(0).clamp(max=0.0)
    high = w.amax(0).clamp(min=0.0)
    scales = ((high - low) / 15).clamp(min=1e-6).half().float()
    return scales, (-low / scales).round().clamp(0, 15)


def quantize_values(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..15 of ``w`` with the given (broadcastable) scales and zeros."""
    return (w / scales + zeros).round().clamp(0, 15)


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, *, dtype: torch.dtype | None = None) -> Int4Weight:
    """``nn.Linear.weight [N, K]`` → :class:`Int4Weight`, rounding each group of ``group_size`` columns of a row
    to the nearest of 16 levels spanning its range."""
    out_features, in_features = weight.shape
    q, scales, zeros = _rounded(weight, group_size)
    dtype = dtype or weight.dtype
    return Int4Weight(
        pack_along_rows(q.reshape(in_features, out_features).to(torch.int32)).to(weight.device),
        scales.to(dtype),
        zeros.to(dtype),
        group_size,
    )


def rtn_round_trip(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``quantize_rtn(weight, group_size).dequantize()`` of a float32 ``weight [N, K]``, the same values, without
    packing the codes: what AWQ's scale search measures for every candidate."""
    q, scales, zeros = _rounded(weight, group_size)  # [G, g, N], [G, N], [G, N]
    return ((q - zeros[:, None]) * scales[:, None]).reshape(weight.shape[1], weight.shape[0]).t()


def _rounded(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The RTN codes ``[G, g, N]`` (float, 0..15) of ``weight [N, K]`` by groups of ``group_size`` input columns, and
    their scales and zeros ``[G, N]``."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")
    w = weight.detach().float().t().reshape(in_features // group_size, group_size, out_features)  # [G, g, N]
    scales, zeros = group_params(w.transpose(0, 1).reshape(group_size, -1))  # [G * N] each
    scales, zeros = scales.view(-1, out_features), zeros.view(-1, out_features)  # [G, N]
    return quantize_values(w, scales[:, None], zeros[:, None]), scales, zeros
