"""Verification: the target judges a step's drafts, each row's verdict drawn on the device.

Lossless: greedy output is the target's own greedy output, token for token; sampled output has exactly the
target's distribution (Leviathan et al. 2023, Chen et al. 2023): drafted token ``d`` is accepted with
probability ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from
``normalize(max(p - q, 0))``; when all drafts pass, one bonus token is drawn from ``p``. ``p`` and ``q`` are
the target's and drafter's distributions after the same warpers (``hfaccel.sampling.warpers``: temperature,
top-k, top-p, as ``generate`` applies them), and every draw is the sampler's exponential race.

Seeded, the random numbers are the engine's (``hfaccel.sampling.sampler``): row ``i`` of a call is stream ``i`` of
the seed — completion ``i`` of an Engine request with that seed — and the token at output index ``t`` is drafted
(or, after all drafts passed, drawn) with the noise the engine's sampler draws it with; the acceptance test and
the draw after a rejection take their own numbers keyed by the same (seed, row, ``t``). So with a draft that
agrees with the target (draft = target) every draft is accepted and the tokens are the engine's, and a rounding
difference changes a token only where the engine's own draw is a near-tie. Every number depends on its key only:
what other rows or steps do changes none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hfaccel.device import to_device
from hfaccel.runner import ModelRunner
from hfaccel.sampling import (
    ACCEPT,
    DRAW,
    RESIDUAL,
    SamplingParams,
    Warping,
    global_noise,
    keyed_race,
    probabilities,
    race,
    seed_key,
    seeded_uniforms,
)

if TYPE_CHECKING:
    from hfaccel.speculative.decoding import Row


@dataclass
class Drafts:
    """A step's proposals, padded to the step's longest: ``tokens [R, K]`` on the target device."""

    tokens: torch.Tensor  # [R, K] int64 (padding past counts[r] is 0)
    counts: list[int]  # drafted tokens per row (<= K)
    probs: torch.Tensor | None  # [R, K, V] fp32 drafter distribution, or None: drafts are deterministic


Keys = tuple[torch.Tensor, torch.Tensor]  # a seeded call's rows' streams and output indices, [R] each


class SpeculativeSampler:
    """Greedy or warped sampling for one call: the sampler's warpers (built once per device) and its exponential
    race, with the engine's keyed numbers when a seed is given (module docstring) and the global generator's
    otherwise."""

    def __init__(self, do_sample: bool, temperature: float, top_k: int | None, top_p: float, seed: int | None):
        if do_sample and not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be a number > 0 when sampling; got {temperature!r}")
        self.do_sample = do_sample
        self.params = (
            SamplingParams(temperature=float(temperature) if do_sample else 0.0, top_k=top_k, top_p=float(top_p))
            if do_sample
            else None
        )
        self.seed = None if seed is None else seed_key(seed)
        self._warpings: dict[torch.device, Warping] = {}

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [..., V]`` -> the sampling distribution ``[..., V]`` (fp32)."""
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        if flat.device not in self._warpings:
            self._warpings[flat.device] = Warping.of([self.params], flat.shape[-1], flat.device)
        return probabilities(flat, self._warpings[flat.device].expand(flat.shape[0])).reshape(logits.shape)

    def keys(self, rows: list[Row], device: torch.device) -> Keys | None:
        """A seeded call's keys on ``device``: each row's stream (its index in the batch) and the output index of
        its next token, ``[R]`` each; None when unseeded or greedy (nothing to key)."""
        if self.seed is None or not self.do_sample:
            return None
        streams, counters = to_device(
            [[row.index for row in rows], [len(row.generated) for row in rows]], torch.long, device
        )  # [2, R]
        return streams, counters

    def draw(self, probs: torch.Tensor, keys: Keys | None, purpose: torch.Tensor | int = DRAW) -> torch.Tensor:
        """One token per row of a distribution ``probs [N, V]`` -> ``[N]``; ``keys``: each row's stream and the
        output index of the token drawn, ``[N]`` each (None: the global generator's noise)."""
        if keys is None:
            return race(probs, global_noise(*probs.shape, probs.device))
        return keyed_race(probs, self.seed, *keys, purpose)

    def acceptance(self, keys: Keys | None, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """U(0, 1) numbers ``[R, K]`` for the acceptance tests of each row's drafts (output indices ``keys[1]``
        to ``keys[1] + K - 1``)."""
        if keys is None:
            return torch.rand(rows, width, device=device)
        streams, counters = keys
        counters = counters[:, None] + torch.arange(width, device=device)  # [R, K]
        return seeded_uniforms(self.seed, counters, streams=streams[:, None], purpose=ACCEPT)


def target_distributions(
    target: ModelRunner, rows: list[Row], drafts: Drafts, sampler: SpeculativeSampler
) -> torch.Tensor:
    """Feed each row's last token and its drafts to the target; its distributions ``[R, K + 1, V]``."""
    num_rows, width = drafts.tokens.shape
    device = drafts.tokens.device
    last = to_device([row.tokens[-1] for row in rows], torch.long, device)  # [R]
    grid = torch.cat([last[:, None], drafts.tokens], 1).reshape(-1)  # [R * (K + 1)]
    take = [r * (width + 1) + j for r, c in enumerate(drafts.counts) for j in range(c + 1)]
    inputs = grid[to_device(take, torch.long, device)]  # [T] packed
    logits = target.forward(
        [row.index for row in rows], inputs, [c + 1 for c in drafts.counts], logits_for="all"
    )  # [T, V]
    starts = [0]
    for c in drafts.counts:
        starts.append(starts[-1] + c + 1)
    spread = [starts[r] + min(j, c) for r, c in enumerate(drafts.counts) for j in range(width + 1)]
    logits = logits[to_device(spread, torch.long, logits.device)].reshape(num_rows, width + 1, -1)
    return sampler.probs(logits) if sampler.do_sample else logits


def verify(
    target_probs: torch.Tensor, drafts: Drafts, sampler: SpeculativeSampler, keys: Keys | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject each row's drafts against the target, on the device; returns (accepted count, next
    token) per row, ``[R]`` each.

    ``target_probs [R, K + 1, V]``: logits (greedy) or warped probabilities (sampling) at each drafted
    position and one past the last. ``keys``: a seeded call's rows' streams and output indices of their first
    drafts (:meth:`SpeculativeSampler.keys`).
    """
    rows, width = drafts.tokens.shape
    device = target_probs.device
    counts = to_device(drafts.counts, torch.long, device)  # [R]
    valid = torch.arange(width, device=device) < counts[:, None]  # [R, K]
    if not sampler.do_sample:
        best = target_probs.argmax(-1)  # [R, K + 1]
        accepted = _leading_true((best[:, :width] == drafts.tokens) & valid)  # [R]
        return accepted, best.gather(1, accepted[:, None])[:, 0]
    p_draft = target_probs[:, :width].gather(2, drafts.tokens[..., None])[..., 0]  # [R, K]
    q_draft = (
        torch.ones_like(p_draft) if drafts.probs is None else drafts.probs.gather(2, drafts.tokens[..., None])[..., 0]
    )
    uniform = sampler.acceptance(keys, rows, width, device)  # [R, K]
    accepted = _leading_true((uniform * q_draft <= p_draft) & valid)  # accept with probability min(1, p/q)
    p_next = target_probs[torch.arange(rows, device=device), accepted]  # [R, V]
    rejected = accepted < counts  # [R]: the next token replaces a rejected draft (else it follows the last)
    if width:
        q_next = _draft_probs_at(drafts, accepted, p_next.shape[-1])
        p_next = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    next_keys = None if keys is None else (keys[0], keys[1] + accepted)  # [R] each
    return accepted, sampler.draw(p_next, next_keys, torch.where(rejected, RESIDUAL, DRAW))


def step_outcomes(drafts: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Each row's step in one tensor for one host read: ``drafts [R, K]``, ``accepted [R]``, ``next_tokens [R]`` ->
    ``[R, K + 2]``: the emitted tokens (the accepted drafts, then the next token; anything after it is unused) and,
    in the last column, the accepted count."""
    emitted = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], 1)  # [R, K + 1]
    emitted.scatter_(1, accepted[:, None], next_tokens[:, None])
    return torch.cat([emitted, accepted[:, None]], 1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(p - q, 0))`` per row of ``[R, V]`` (``p`` where the difference vanishes)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def _draft_probs_at(drafts: Drafts, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """The drafter's distribution at each row's ``position`` (one-hot for deterministic drafts): ``[R, V]``."""
    rows, width = drafts.tokens.shape
    index = position.clamp_max(width - 1)
    arange = torch.arange(rows, device=position.device)
    if drafts.probs is not None:
        return drafts.probs[arange, index]
    tokens = drafts.tokens[arange, index]  # [R]
    # a one-hot by scatter: F.one_hot off CUDA reads the tokens on the host to check their range
    return torch.zeros(rows, vocab, device=tokens.device, dtype=torch.float32).scatter_(1, tokens[:, None], 1.0)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row of ``mask [R, K]``, how many leading entries are True -> ``[R]`` int64."""
    return mask.long().cumprod(1).sum(1)
