"""The sampling distribution — temperature, top-k, top-p, min-p — batched, each row with its own values.

The rule is transformers' warpers' (``generate(do_sample=True, ...)``), in generate's order: the logits are
divided by the temperature; top-k keeps the tokens at least as likely as the k-th most likely one (ties
included); top-p keeps the most likely tokens while the mass before them, renormalised over what top-k kept, is
below ``top_p``; min-p keeps the tokens with at least ``min_p`` times the top probability. The most likely token
always survives. The survivors are a prefix of the tokens sorted by probability.

The sampler races the survivors in vocabulary order (:func:`kept_probabilities`, see ``hfaccel.sampling.sampler``);
speculative decoding needs the renormalised distribution (:func:`probabilities`) to accept or reject drafted
tokens, and draws from it by the same race.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hfaccel import compat
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

    def expand(self, rows: int) -> Warping:
        """A one-row warping's values for ``rows`` rows (a view: nothing is copied or sent to the device)."""
        return Warping(*(t.expand(rows) for t in (self.temperature, self.top_k, self.top_p, self.min_p)))


def kept_probabilities(logits: torch.Tensor, warping: Warping) -> torch.Tensor:
    """``logits [R, V]`` -> ``[R, V]``: the probabilities after temperature, in vocabulary order, 0 for the
    tokens top-k / top-p / min-p filter out, not renormalised."""
    probs = torch.softmax(logits.float() / warping.temperature[:, None], -1)  # [R, V]
    sorted_probs, order = probs.sort(-1, descending=True)  # [R, V] each
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_mask(sorted_probs, warping))
    return probs * keep


def probabilities(logits: torch.Tensor, warping: Warping) -> torch.Tensor:
    """The renormalised sampling distribution ``[R, V]`` (vocabulary order) of ``logits [R, V]``."""
    kept = kept_probabilities(logits, warping)
    return kept / kept.sum(-1, keepdim=True)


def keep_mask(sorted_probs: torch.Tensor, warping: Warping) -> torch.Tensor:
    """Which of the descending-sorted tokens ``[R, V]`` survive top-k, then top-p over what top-k left
    (renormalised, as transformers' warpers chain), then min-p. The survivors are a prefix."""
    vocab = sorted_probs.shape[-1]
    kth = sorted_probs.gather(1, (warping.top_k.clamp(1, vocab) - 1)[:, None])  # [R, 1]
    keep = sorted_probs >= kth  # top-k, ties with the k-th included
    in_top_k = sorted_probs * keep
    in_top_k = in_top_k / in_top_k.sum(-1, keepdim=True)
    before = compat.cumsum(in_top_k, -1) - in_top_k  # mass of the more likely tokens, within top-k
    keep &= (before < warping.top_p[:, None]) & (sorted_probs >= warping.min_p[:, None] * sorted_probs[:, :1])
    # the most likely token survives (an or with a column mask, not a write into the first column: in a compiled
    # step that write specialises the batch size on 1)
    return keep | (torch.arange(vocab, device=keep.device) == 0)
