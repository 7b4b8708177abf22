"""Sampling and stopping, once for every path: the engine, speculative decoding and hfaccel's generate."""

from hfaccel.sampling.params import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams, TokenLogprob
from hfaccel.sampling.sampler import SampledTokens, SampleRow, sample
from hfaccel.sampling.stopping import IncrementalDetokenizer, StopChecker, eos_token_ids, token_ids
from hfaccel.sampling.warpers import Warping, inverse_cdf, keep_mask, probabilities, sorted_distribution

__all__ = ["MAX_LOGPROBS", "IncrementalDetokenizer", "InvalidSamplingParams", "SampleRow", "SampledTokens",
           "SamplingParams", "StopChecker", "TokenLogprob", "Warping", "eos_token_ids", "inverse_cdf", "keep_mask",
           "probabilities", "sample", "sorted_distribution", "token_ids"]
