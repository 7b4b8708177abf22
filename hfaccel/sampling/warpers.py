"""The sampling distribution — temperature, top-k, top-p, min-p — batched, each row with its own values.

The rule is transformers' warpers' (``generate(do_sample=True, ...)``), in generate's order: the logits are
divided by the temperature; top-k keeps the tokens at least as likely as the k-th most likely one (ties
included); top-p keeps the most likely tokens while the mass before them, renormalised over what top-k kept, is
below ``top_p``; min-p keeps the tokens with at least ``min_p`` times the top probability. The most likely token
always survives. The survivors are a prefix of the tokens sorted by probability.

The engine's sampler draws from the sorted survivors (:func:`sorted_distribution`); speculative decoding needs
the distribution itself, in vocabulary order (:func:`probabilities`), to accept or reject drafted tokens. Both
draw by inverse CDF with one uniform number per row (:func:`inverse_cdf`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hfaccel.device import to_device
from hfaccel.sampling.params import SamplingParams


@dataclass(frozen=True)
class Warping:
    """Per-row warper values as device tensors (``top_k`` = vocabulary size where it is off)."""

    temperature: torch.Tensor  # [R] float
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor  # [R] float
    min_p: torch.Tensor  # [R] float

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> Warping:
        """The values of ``params`` (one per row); a greedy row's temperature counts as 1."""
        return cls(
            temperature=to_device([p.temperature or 1.0 for p in params], torch.float, device),
            top_k=to_device([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params], torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float, device),
            min_p=to_device([p.min_p for p in params], torch.float, device),
        )

    def repeat_interleave(self, repeats: int) -> Warping:
        """Each row's values ``repeats`` times in a row (several positions of one sequence)."""
        return Warping(*(t.repeat_interleave(repeats) for t in (self.temperature, self.top_k, self.top_p, self.min_p)))


def sorted_distribution(logits: torch.Tensor, warping: Warping) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [R, V]`` -> (``kept [R, V]``: the probabilities sorted in descending order, 0 for filtered
    tokens, not renormalised; ``order [R, V]``: the token id at each sorted position)."""
    probs = torch.softmax(logits.float() / warping.temperature[:, None], -1)
    sorted_probs, order = probs.sort(-1, descending=True)  # [R, V]
    return sorted_probs * keep_mask(sorted_probs, warping), order


def probabilities(logits: torch.Tensor, warping: Warping) -> torch.Tensor:
    """The renormalised sampling distribution ``[R, V]`` (vocabulary order) of ``logits [R, V]``."""
    kept, order = sorted_distribution(logits, warping)
    return torch.zeros_like(kept).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))


def keep_mask(sorted_probs: torch.Tensor, warping: Warping) -> torch.Tensor:
    """Which of the descending-sorted tokens ``[R, V]`` survive top-k, then top-p over what top-k left
    (renormalised, as transformers' warpers chain), then min-p. The survivors are a prefix."""
    vocab = sorted_probs.shape[-1]
    kth = sorted_probs.gather(1, (warping.top_k.clamp(1, vocab) - 1)[:, None])  # [R, 1]
    keep = sorted_probs >= kth  # top-k, ties with the k-th included
    in_top_k = sorted_probs * keep
    in_top_k = in_top_k / in_top_k.sum(-1, keepdim=True)
    before = in_top_k.cumsum(-1) - in_top_k  # mass of the more likely tokens, within top-k
    keep &= (before < warping.top_p[:, None]) & (sorted_probs >= warping.min_p[:, None] * sorted_probs[:, :1])
    keep[:, 0] = True
    return keep


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights [R, V]`` (non-negative, any total), the index whose CDF interval holds
    ``uniform [R]`` (in [0, 1)) times the row's total -> ``[R]`` int64. Never an index of weight 0."""
    cdf = weights.cumsum(-1)  # [R, V]
    pick = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]  # [R]
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(-1)  # rounding never passes it
    return torch.minimum(pick, last)
