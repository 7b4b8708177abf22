"""The one sampling distribution (hfaccel.sampling.warpers) is transformers' warpers', batched per row."""

import pytest
import torch

from hfaccel.sampling import SamplingParams, Warping, keep_mask, probabilities
from tests.sampling.reference import transformers_probabilities


def _warping(params: SamplingParams, rows: int, vocab: int) -> Warping:
    return Warping.of([params] * rows, vocab, torch.device("cpu"))


def test_sampling_filters_match_transformers_warpers():
    """top-k, then top-p over what top-k kept, then min-p: the tokens the engine can draw are exactly those
    transformers' warpers leave a probability."""
    gen = torch.Generator().manual_seed(0)
    for top_k, top_p in [(3, 0.5), (None, 0.9), (10, 0.95), (1, 1.0), (50, 0.3)]:
        logits = torch.randn(4, 60, generator=gen) * 3
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        probs = torch.softmax(logits, -1)
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = keep_mask(sorted_probs, _warping(params, 4, 60))
        engine_set = [set(order[r][keep[r]].tolist()) for r in range(4)]
        reference = transformers_probabilities(logits, 1.0, top_k, top_p)
        assert engine_set == [set(reference[r].nonzero()[:, 0].tolist()) for r in range(4)], (top_k, top_p)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (0.7, None, 1.0, 0.0),
        (1.3, 7, 1.0, 0.0),
        (0.9, 20, 0.8, 0.0),
        (1.0, None, 0.6, 0.05),
        (0.5, 13, 0.95, 0.1),
    ],
)
def test_probabilities_equal_transformers(temperature, top_k, top_p, min_p):
    logits = torch.randn(5, 97, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = transformers_probabilities(logits, temperature, top_k, top_p, min_p or None)
    torch.testing.assert_close(probabilities(logits, _warping(params, 5, 97)), expected, atol=1e-6, rtol=1e-5)


def test_top_k_keeps_ties_with_the_kth_token_as_transformers_does():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5]])
    params = SamplingParams(top_k=2)
    got = probabilities(logits, _warping(params, 1, 6))
    torch.testing.assert_close(got, transformers_probabilities(logits, top_k=2))
    assert (got[0] > 0).tolist() == [True, False, True, True, True, False]


def test_rows_keep_their_own_parameters():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(temperature=2.0)]
    got = probabilities(logits, Warping.of(params, 50, torch.device("cpu")))
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], transformers_probabilities(logits[row], p.temperature, p.top_k, p.top_p))


def test_an_expanded_warping_is_the_warping_of_every_row():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.7, top_k=9, top_p=0.8, min_p=0.02)
    one = Warping.of([params], 60, torch.device("cpu"))
    assert torch.equal(probabilities(logits, one.expand(4)), probabilities(logits, _warping(params, 4, 60)))
