"""The batched sampler's seeded rows: numbers from a counter-based generator keyed by (seed, token index) —
uniform, reproducible, independent of the batch — that sample the warped distribution."""

import torch

from hfaccel.sampling import SampleRow, SamplingParams, Warping, probabilities, sample
from hfaccel.sampling.sampler import seeded_uniforms
from tests.sampling.reference import chi_square_p_value


def _uniform_fit(values: torch.Tensor, bins: int = 50) -> float:
    counts = torch.histc(values.double(), bins=bins, min=0.0, max=1.0)
    return chi_square_p_value(counts, torch.full((bins,), 1.0 / bins))


def test_seeded_uniforms_are_uniform_over_counters_and_over_seeds():
    n = 50_000
    counters = torch.arange(n)
    along_counters = seeded_uniforms(torch.full((n,), 42), counters)
    along_seeds = seeded_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))
    high_seeds = seeded_uniforms(torch.arange(n) << 32, torch.full((n,), 7))  # seeds that differ in high bits only
    for values in (along_counters, along_seeds, high_seeds):
        assert values.dtype == torch.float32 and 0 <= values.min() and values.max() < 1
        assert _uniform_fit(values) > 1e-3
    successive = torch.corrcoef(torch.stack([along_counters[:-1], along_counters[1:]]))[0, 1]
    assert abs(successive) < 0.02  # consecutive tokens of one request draw unrelated numbers


def test_seeded_uniforms_depend_on_the_pair_only():
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1, 1])
    counters = torch.tensor([0, 0, 3, 9, 1])
    values = seeded_uniforms(seeds, counters)
    again = seeded_uniforms(seeds.flip(0), counters.flip(0)).flip(0)
    assert torch.equal(values, again) and len(set(values.tolist())) == 5


def _rows(params: SamplingParams, seeds: list[int | None], counter: int = 0) -> list[SampleRow]:
    return [SampleRow(params, seed, [1, 2], [], counter=counter) for seed in seeds]


def test_seeded_rows_sample_the_warped_distribution():
    logits = torch.randn(1, 23, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    rows = 20_000
    tokens = sample(logits.expand(rows, -1), _rows(params, list(range(rows)))).tokens
    expected = probabilities(logits, Warping.of([params], 23, logits.device))[0]
    assert chi_square_p_value(torch.bincount(tokens, minlength=23), expected) > 1e-3


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    params = SamplingParams(temperature=1.0)
    for counter in range(5):
        crowd = sample(logits, _rows(params, [None, 3, None, 99, 5, None], counter)).tokens
        for row in (1, 3, 4):
            alone = sample(logits[row:row + 1], _rows(params, [[None, 3, None, 99, 5, None][row]], counter)).tokens
            assert int(alone[0]) == int(crowd[row])
