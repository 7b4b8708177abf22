"""Drafters: what proposes each row's next tokens for the target to verify — a smaller model through its own
runner, or prompt lookup (the tokens that followed the row's last n-gram earlier in it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from hfaccel.device import to_device
from hfaccel.runner import ModelRunner
from hfaccel.speculative.verification import Drafts, Keys, SpeculativeSampler

if TYPE_CHECKING:
    from hfaccel.speculative.decoding import Row


class Drafter(Protocol):
    """Proposes a step's drafts, and follows each row's cache as verification cuts it back."""

    def propose(self, rows: list[Row], counts: list[int], sampler: SpeculativeSampler) -> Drafts:
        """Up to ``counts[i]`` drafted tokens for ``rows[i]``."""

    def accept(self, row: Row, kept: int) -> None:
        """The row now holds ``kept`` tokens: what the drafter saw past them is dropped."""

    def free(self, row: Row) -> None:
        """The row finished."""


class ModelDrafter:
    """Drafts with a smaller model through its own :class:`ModelRunner`."""

    def __init__(self, runner: ModelRunner, target_device: torch.device):
        self.runner = runner
        self.target_device = target_device

    def propose(self, rows: list[Row], counts: list[int], sampler: SpeculativeSampler) -> Drafts:
        """Draft ``counts[i]`` tokens for ``rows[i]``: first the tokens the draft has not seen, then one per step."""
        runner, device = self.runner, self.runner.device
        pending = [row.tokens[runner.seq_len(row.index) if row.index in runner.pool.manager else 0 :] for row in rows]
        width = max(counts)
        drafted = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # [R, K]
        live = [i for i, c in enumerate(counts) if c > 0]
        if not live:
            return Drafts(drafted.to(self.target_device), counts, None)
        draft_probs = []
        keys = sampler.keys(rows, device)  # the rows' streams and output indices, or None
        logits = runner.forward(
            [rows[i].index for i in live],
            to_device([t for i in live for t in pending[i]], torch.long, device),
            [len(pending[i]) for i in live],
        )
        for step in range(width):
            where = to_device(live, torch.long, device)  # [R']: the drafting rows
            step_keys = None if keys is None else (keys[0][where], keys[1][where] + step)  # [R'] each
            tokens, probs = self._draw(logits, sampler, step_keys)  # [R'], [R', V] or None
            drafted[:, step].index_copy_(0, where, tokens)
            if probs is not None:
                draft_probs.append(probs.new_zeros(len(rows), probs.shape[-1]).index_copy_(0, where, probs))
            live_next = [j for j, i in enumerate(live) if counts[i] > step + 1]
            if not live_next:
                break
            live = [live[j] for j in live_next]
            logits = runner.forward(
                [rows[i].index for i in live], tokens[to_device(live_next, torch.long, device)], [1] * len(live)
            )
        probs = None
        if draft_probs:
            probs = torch.stack(draft_probs, 1).to(self.target_device)  # [R, K', V]
            probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))
        return Drafts(drafted.to(self.target_device), counts, probs)

    @staticmethod
    def _draw(
        logits: torch.Tensor, sampler: SpeculativeSampler, keys: Keys | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafted tokens ``[R']`` of ``logits [R', V]`` and their distribution (None: greedy)."""
        if not sampler.do_sample:
            return logits.argmax(-1), None
        probs = sampler.probs(logits)  # [R', V]
        return sampler.draw(probs, keys), probs

    def accept(self, row: Row, kept: int) -> None:
        """The row now holds ``kept`` tokens that the draft cache may still vouch for."""
        if row.index in self.runner.pool.manager:
            self.runner.crop(row.index, min(self.runner.seq_len(row.index), kept))

    def free(self, row: Row) -> None:
        self.runner.free(row.index)


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the row's last n-gram."""

    def __init__(self, max_ngram: int, target_device: torch.device):
        if max_ngram < 1:
            raise ValueError(f"ngram_size must be >= 1; got {max_ngram}")
        self.max_ngram = max_ngram
        self.target_device = target_device

    def propose(self, rows: list[Row], counts: list[int], sampler: SpeculativeSampler) -> Drafts:
        proposals = [lookup_continuation(row.tokens, self.max_ngram, count) for row, count in zip(rows, counts)]
        width = max((len(p) for p in proposals), default=0)
        padded = [p + [0] * (width - len(p)) for p in proposals]
        tokens = to_device(padded, torch.long, self.target_device).reshape(len(rows), width)  # [R, K]
        return Drafts(tokens, [len(p) for p in proposals], None)

    def accept(self, row: Row, kept: int) -> None:
        return None

    def free(self, row: Row) -> None:
        return None


def lookup_continuation(tokens: Sequence[int], max_ngram: int, count: int) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
    if count <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + count])
    return []
