"""Sampling and stopping, once for every path: the engine, speculative decoding and hfaccel's generate."""

from hfaccel.kernels.keyed_race import keyed_noise, keyed_race, seeded_uniforms
from hfaccel.sampling.params import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams, TokenLogprob
from hfaccel.sampling.penalties import TokenCounts
from hfaccel.sampling.sampler import (
    ACCEPT,
    DRAW,
    RESIDUAL,
    SampledTokens,
    SampleRow,
    draw_columns,
    draw_step,
    draws_in_step,
    global_noise,
    race,
    sample,
    seed_key,
)
from hfaccel.sampling.structured import StructuredOutputs
from hfaccel.sampling.stopping import IncrementalDetokenizer, StopChecker, eos_token_ids, token_ids
from hfaccel.sampling.warpers import Warping, keep_mask, kept_probabilities, probabilities

__all__ = [
    "ACCEPT",
    "DRAW",
    "MAX_LOGPROBS",
    "RESIDUAL",
    "IncrementalDetokenizer",
    "InvalidSamplingParams",
    "SampleRow",
    "SampledTokens",
    "SamplingParams",
    "StopChecker",
    "StructuredOutputs",
    "TokenCounts",
    "TokenLogprob",
    "Warping",
    "draw_columns",
    "draw_step",
    "draws_in_step",
    "eos_token_ids",
    "global_noise",
    "keep_mask",
    "kept_probabilities",
    "keyed_noise",
    "keyed_race",
    "probabilities",
    "race",
    "sample",
    "seed_key",
    "seeded_uniforms",
    "token_ids",
]
