"""Lossless, batched speculative decoding over hfaccel's runner (a draft model, or prompt lookup)."""

from hfaccel.speculative.decoding import SpeculativeStats, speculative_generate, vocab_size
from hfaccel.speculative.drafters import lookup_continuation
from hfaccel.speculative.runners import SpeculativeRunners

__all__ = ["SpeculativeRunners", "SpeculativeStats", "lookup_continuation", "speculative_generate", "vocab_size"]
