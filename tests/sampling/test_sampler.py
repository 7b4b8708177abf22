"""The batched sampler's draw: an exponential race whose seeded noise comes from a counter-based generator keyed by
(seed, stream, purpose, output index, token id) — uniform, reproducible, independent of the batch, computed on the
device without host work — and which samples the warped distribution exactly."""

import pytest
import torch

from hfaccel.sampling import (
    ACCEPT,
    DRAW,
    RESIDUAL,
    SampleRow,
    SamplingParams,
    Warping,
    keyed_noise,
    kept_probabilities,
    probabilities,
    race,
    sample,
    seed_key,
    seeded_uniforms,
)
from hfaccel.sampling import sampler as sampler_module
from tests.sampling.reference import chi_square_p_value
from tests.speculative.host_reads import HostReads

VOCAB = 23
WARPED = [
    SamplingParams(temperature=0.8, top_k=12, top_p=0.95),
    SamplingParams(temperature=1.5, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=1.0),
]


def _uniform_fit(values: torch.Tensor, bins: int = 50) -> float:
    counts = torch.histc(values.double(), bins=bins, min=0.0, max=1.0)
    return chi_square_p_value(counts, torch.full((bins,), 1.0 / bins))


def test_seeded_uniforms_are_uniform_along_every_part_of_the_key():
    n = 50_000
    index, zeros = torch.arange(n), torch.zeros(n, dtype=torch.long)
    along = {
        "counters": seeded_uniforms(torch.full((n,), 42), index),
        "seeds": seeded_uniforms(index, zeros),
        "high seeds": seeded_uniforms(index << 32, torch.full((n,), 7)),  # seeds that differ in high bits only
        "negative seeds": seeded_uniforms(-index - 1, zeros),
        "tokens": seeded_uniforms(torch.tensor(5), torch.tensor(3), index),
        "streams": seeded_uniforms(torch.tensor(5), torch.tensor(3), streams=index),
        "streams and tokens": seeded_uniforms(torch.tensor(5), torch.tensor(0), index % 97, streams=index // 97),
    }
    for name, values in along.items():
        assert values.dtype == torch.float32 and 0 < values.min() and values.max() < 1, name
        assert _uniform_fit(values) > 1e-3, name
        successive = torch.corrcoef(torch.stack([values[:-1], values[1:]]))[0, 1]
        assert abs(successive) < 0.02, name  # neighbouring keys draw unrelated numbers


def test_seeded_uniforms_depend_on_the_key_only():
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1, 1, -1])
    counters = torch.tensor([0, 0, 3, 9, 1, 4])
    values = seeded_uniforms(seeds, counters)
    again = seeded_uniforms(seeds.flip(0), counters.flip(0)).flip(0)
    assert torch.equal(values, again) and len(set(values.tolist())) == 6
    one = seeded_uniforms(seed_key(2**64 - 1), torch.tensor([4]))  # a Python int seed is the same key
    assert torch.equal(one, values[5:])
    purposes = [seeded_uniforms(torch.tensor(3), torch.arange(1000), purpose=p) for p in (DRAW, ACCEPT, RESIDUAL)]
    for a, b in [(0, 1), (0, 2), (1, 2)]:  # distinct purposes are distinct streams
        assert abs(torch.corrcoef(torch.stack([purposes[a], purposes[b]]))[0, 1]) < 0.1


def test_seeded_numbers_are_pinned():
    """A seed gives the same tokens across restarts and releases: the generator's numbers never change silently
    (and the key of all zeros is no fixed point of the hash)."""
    values = seeded_uniforms(
        torch.tensor([0, 1234, -1]),
        torch.tensor([0, 7, 3]),
        torch.tensor([0, 5, 95]),
        streams=torch.tensor([0, 2, 0]),
        purpose=torch.tensor([DRAW, DRAW, ACCEPT]),
    )
    assert values.tolist() == [0.8588654398918152, 0.6630362272262573, 0.8732761740684509]


def test_seed_key_folds_any_int_into_int64():
    assert [seed_key(s) for s in (0, 5, 2**63 - 1, 2**63, 2**64 - 1, -7, 2**64 + 5)] == [
        0,
        5,
        2**63 - 1,
        -(2**63),
        -1,
        -7,
        5,
    ]


def _rows(params: SamplingParams, seeds: list[int | None], counter: int = 0) -> list[SampleRow]:
    return [SampleRow(params, seed, [1, 2], [], counter=counter) for seed in seeds]


def _keyed_rows(params: SamplingParams, keys: list[tuple[int, int, int]]) -> list[SampleRow]:
    """One row per (seed, stream, counter)."""
    return [SampleRow(params, seed, [1, 2], [], counter=counter, stream=stream) for seed, stream, counter in keys]


def _draws(logits: torch.Tensor, params: SamplingParams, rows: list[SampleRow]) -> torch.Tensor:
    """Each row's token from the same ``logits [1, V]``: a histogram ``[V]``."""
    tokens = sample(logits.expand(len(rows), -1), rows).tokens
    return torch.bincount(tokens, minlength=logits.shape[-1])


def _expected(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return probabilities(logits, Warping.of([params], logits.shape[-1], logits.device))[0]


@pytest.mark.parametrize("params", WARPED, ids=["top_k-top_p", "flat-top_p", "flat-min_p", "plain"])
def test_seeded_draws_follow_the_warped_distribution_over_seeds_counters_and_streams(params):
    """100,000 keys along each part of the key: a bias of a few percent on any token would be caught."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    expected = _expected(logits, params)
    n = 100_000
    for keys in ([(i, 0, 0) for i in range(n)], [(7, 0, i) for i in range(n)], [(7, i, 3) for i in range(n)]):
        counts = _draws(logits, params, _keyed_rows(params, keys))
        assert chi_square_p_value(counts, expected) > 1e-3


def test_unseeded_draws_follow_the_warped_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    params = WARPED[0]
    counts = _draws(logits, params, _rows(params, [None] * 100_000))
    assert chi_square_p_value(counts, _expected(logits, params)) > 1e-3


def test_the_distribution_test_has_power(monkeypatch):
    """Uniform instead of exponential noise races to a distribution a little off the warped one: caught."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    params = WARPED[0]

    def uniform_race(weights, seeds, streams, counters, purpose):
        return race(weights, 1 - torch.exp(-keyed_noise(seeds, streams, counters, weights.shape[-1], purpose)))

    monkeypatch.setattr(sampler_module, "keyed_race", uniform_race)
    counts = _draws(logits, params, _rows(params, list(range(100_000))))
    assert chi_square_p_value(counts, _expected(logits, params)) < 1e-6


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    params = SamplingParams(temperature=1.0)
    seeds = [None, 3, None, 99, 5, None]
    for counter in range(5):
        crowd = sample(logits, _rows(params, seeds, counter)).tokens
        for row in (1, 3, 4):
            alone = sample(logits[row : row + 1], _rows(params, [seeds[row]], counter)).tokens
            assert int(alone[0]) == int(crowd[row])


@pytest.mark.parametrize("params", WARPED[1:3], ids=["flat-top_p", "flat-min_p"])
def test_a_rounding_change_of_the_logits_moves_no_seeded_token(params):
    """A batch rounds a row's logits differently (~1e-6): on flat distributions an inverse CDF would move some of
    2,000 seeded draws; the race moves none (only a true near-tie of p_i / e_i could)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2000, 96, generator=gen) * 0.5  # [R, V]: flat, many near-equal probabilities
    rounded = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=gen))
    rows = _rows(params, list(range(2000)), counter=11)
    assert torch.equal(sample(logits, rows).tokens, sample(rounded, rows).tokens)


def test_the_race_runs_on_the_device_without_host_work():
    """Keyed noise and the race read nothing on the host, upload nothing and trace into one graph (no
    data-dependent shape or branch): what a CUDA graph capture needs."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    warping = Warping.of(WARPED[:1], VOCAB, logits.device).expand(4)
    seeds, streams, counters = torch.tensor([1, 2, -3, 4]), torch.tensor([0, 1, 0, 2]), torch.tensor([5, 0, 9, 2])

    def draw(logits, seeds, streams, counters):
        return race(kept_probabilities(logits, warping), keyed_noise(seeds, streams, counters, VOCAB))

    with HostReads() as waits:
        eager = draw(logits, seeds, streams, counters)
    assert waits.reads == [] and waits.uploads == []
    traced = torch.compile(draw, backend="eager", fullgraph=True, dynamic=False)
    assert torch.equal(traced(logits, seeds, streams, counters), eager)


def _step_rows() -> list[SampleRow]:
    """A mixed step: greedy, seeded rows under each warper (several streams and output indices), a logprobs-free
    unseeded one."""
    rows = [SampleRow(SamplingParams(temperature=0), None, [1], [])]
    rows += [SampleRow(params, 40 + i, [1], [], counter=3 * i, stream=i % 2) for i, params in enumerate(WARPED)]
    rows += [SampleRow(SamplingParams(temperature=1.4, top_k=7, seed=5), 2**64 - 3, [1], [], counter=9)]
    return rows


def test_the_in_step_draw_picks_the_samplers_tokens():
    """draw_step (the decode step's own draw, from draw_columns) gives every greedy and seeded row the token
    sample() gives it, on odd sizes; all-zero padding rows take the argmax; the float parameters travel exactly."""
    rows = _step_rows()
    columns = sampler_module.draw_columns(rows)
    assert [len(column) for column in columns] == [len(rows)] * len(sampler_module.DRAW_COLUMNS)
    floats = torch.tensor(columns[5:], dtype=torch.int32).view(torch.float32)
    assert floats[0].tolist() == [torch.tensor(r.params.temperature or 1.0).item() for r in rows]
    gen = torch.Generator().manual_seed(8)
    for counter_shift in range(3):
        logits = torch.randn(len(rows) + 2, 37, generator=gen) * 1.5  # [R + 2 padding, V]
        padded = torch.tensor(columns, dtype=torch.long)
        padded[4] += counter_shift
        padded = torch.cat([padded, torch.zeros(len(padded), 2, dtype=torch.long)], 1)  # [8, R + 2]
        got = sampler_module.draw_step(logits, padded)
        shifted = [
            SampleRow(r.params, r.seed, [1], [], counter=r.counter + counter_shift, stream=r.stream) for r in rows
        ]
        assert got.tolist()[: len(rows)] == sample(logits[: len(rows)], shifted).tokens.tolist()
        assert got.tolist()[len(rows) :] == logits[len(rows) :].argmax(-1).tolist()


@pytest.mark.parametrize("split_scan_fails", [False, True], ids=["torch-cumsum", "opaque-cumsum"])
def test_the_in_step_draw_compiles_whole_and_reads_nothing_on_the_host(monkeypatch, split_scan_fails):
    """The draw a captured step ends with: no host read or upload, one fullgraph compile over every batch size
    (inductor, as the compiled decode step runs it), the eager tokens for greedy and seeded rows; also with the
    top-p cumsum as the opaque op torch < 2.13 compiles it through (``compat.cumsum``)."""
    from torch._dynamo.utils import counters

    from hfaccel import compat
    from hfaccel.compat import torch as torch_compat

    monkeypatch.setattr(torch_compat, "SPLIT_SCAN_FAILS", split_scan_fails)  # where compat.cumsum reads it
    targets = []

    def inductor(graph, example_inputs):
        targets.extend(str(node.target) for node in graph.graph.nodes)
        return compat.inductor_backend(graph, example_inputs)

    rows = _step_rows()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5))
    columns = torch.zeros(len(sampler_module.DRAW_COLUMNS), 16, dtype=torch.long)  # [8, 16]: a step's buffer
    columns[:, : len(rows)] = torch.tensor(sampler_module.draw_columns(rows))
    with HostReads() as waits:
        eager = sampler_module.draw_step(logits, columns[:, : len(rows)])
    assert waits.reads == [] and waits.uploads == []
    compiled = torch.compile(sampler_module.draw_step, fullgraph=True, dynamic=None, backend=inductor)
    before = counters["stats"]["unique_graphs"]
    for size in (len(rows), 1, 3):
        rows_logits, rows_columns = logits[:size], columns[:, :size]
        torch._dynamo.maybe_mark_dynamic(rows_logits, 0)
        torch._dynamo.maybe_mark_dynamic(rows_columns, 1)
        with compat.marked_sizes_only():
            got = compiled(rows_logits, rows_columns)
        assert got.tolist() == eager[:size].tolist()
    assert counters["stats"]["unique_graphs"] - before == 1
    assert ("hfaccel.cumsum.default" in targets) == split_scan_fails


def test_the_opaque_cumsum_op_agrees_with_its_schema_and_fake():
    """torch.ops.hfaccel.cumsum (the top-p cumsum torch < 2.13 compiles through): schema, fake implementation and
    autograd registration agree (opcheck) on odd sizes along either dimension, a transposed input too, and it is
    torch.cumsum's values, contiguous."""
    from hfaccel.compat.torch import opaque_cumsum

    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(7))
    for tensor, dim in ((x, 1), (x, 0), (x.T, 1)):
        torch.library.opcheck(opaque_cumsum, (tensor, dim))
        out = opaque_cumsum(tensor, dim)
        assert out.is_contiguous() and torch.equal(out, torch.cumsum(tensor, dim))


def test_unseeded_in_step_draws_follow_the_warped_distribution():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    params = WARPED[1]
    rows = _rows(params, [None] * 50_000)
    tokens = sampler_module.draw_step(logits.expand(len(rows), -1), torch.tensor(sampler_module.draw_columns(rows)))
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert chi_square_p_value(counts, _expected(logits, params)) > 1e-3
