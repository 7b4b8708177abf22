"""transformers' own warpers, the reference hfaccel's sampling distribution is checked against, and a goodness-of-fit
test for samples."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def transformers_probabilities(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    min_p: float | None = None,
) -> torch.Tensor:
    """``logits [..., V]`` -> the fp32 distribution ``generate(do_sample=True, ...)`` samples from."""
    chain = LogitsProcessorList()
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        chain.append(TopKLogitsWarper(top_k=int(top_k)))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=float(top_p)))
    if min_p:
        chain.append(MinPLogitsWarper(min_p=float(min_p)))
    flat = logits.reshape(-1, logits.shape[-1]).float()  # [N, V]
    return torch.softmax(chain(None, flat) if chain else flat, dim=-1).reshape(logits.shape)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs``; cells expecting < 5 samples are pooled."""
    counts, expected = counts.flatten().double(), probs.flatten().double().cpu() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()
