"""Token distributions from logits, with transformers' own temperature / top-k / top-p warpers.

Using transformers' warpers (not a re-implementation) keeps hfaccel's sampling distribution identical to
``model.generate(do_sample=True, ...)`` for the same parameters, ties and ``min_tokens_to_keep`` included.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def check_sampling_params(temperature: float, top_k: int | None, top_p: float) -> None:
    """Raise ValueError for parameters no distribution can be built from."""
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0 when sampling; got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be an int >= 0 (0 or None: off); got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")


def warpers(temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0) -> LogitsProcessorList:
    """The warpers ``generate`` applies for these parameters, in its order (temperature, top-k, top-p)."""
    check_sampling_params(temperature, top_k, top_p)
    chain = LogitsProcessorList()
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        chain.append(TopKLogitsWarper(top_k=int(top_k)))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=float(top_p)))
    return chain


def probabilities(logits: torch.Tensor, chain: LogitsProcessorList) -> torch.Tensor:
    """``logits [..., V]`` -> fp32 probabilities ``[..., V]`` after the warpers (filtered tokens get 0)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()  # [N, V]
    scores = chain(None, flat) if chain else flat
    return torch.softmax(scores, dim=-1).reshape(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` -> ``[N]`` int64."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
