"""Lossless, batched speculative decoding over hfaccel's runner (a draft model, or prompt lookup)."""

from hfaccel.speculative.decoding import (
    SpeculativeRunners, SpeculativeStats, lookup_continuation, speculative_generate, vocab_size,
)

__all__ = ["SpeculativeRunners", "SpeculativeStats", "lookup_continuation", "speculative_generate", "vocab_size"]
