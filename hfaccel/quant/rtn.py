"""Round-to-nearest (RTN) int4 quantization: asymmetric, per group of input columns, per output row."""

from __future__ import annotations

import torch

from hfaccel.quant.formats import Int4Weight, pack_along_rows


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, *, dtype: torch.dtype | None = None) -> Int4Weight:
    """``nn.Linear.weight [N, K]`` → :class:`Int4Weight`; each group of ``group_size`` columns of a row maps
    its [min, max] (widened to include 0) onto 0..15."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")
    w = weight.detach().float().t().reshape(in_features // group_size, group_size, out_features)  # [G, g, N]
    low = w.amin(1).clamp(max=0.0)
    high = w.amax(1).clamp(min=0.0)
    scales = ((high - low) / 15).clamp(min=1e-8)  # [G, N]
    zeros = (-low / scales).round().clamp(0, 15)
    q = (w / scales[:, None] + zeros[:, None]).round().clamp(0, 15)  # [G, g, N]
    dtype = dtype or weight.dtype
    return Int4Weight(pack_along_rows(q.reshape(in_features, out_features).to(torch.int32)).to(weight.device),
                      scales.to(dtype), zeros.to(dtype), group_size)
