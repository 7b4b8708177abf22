"""A seeded request's tokens are the same whatever runs beside it: alone, in a batch of 16 with greedy and other
sampled neighbours, under preemption, with prefix reuse and drawn inside static decode steps — on flat
distributions (temperature >= 1.3 on a tiny random model; top-p, top-k, min-p), where a batch's float rounding
would move an inverse-CDF draw.

A GPU's kernels round a row's logits differently in different batches; the CPU's tiny forwards happen not to, so
every step's logits get a perturbation (:func:`_rounding`) that differs from step to step. With it, the
inverse-CDF sampler the race replaced (one uniform number per row over the sorted distribution) fails every case
here.
"""

import contextlib
import itertools
import random
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.sampling import sample
from hfaccel.sampling.sampler import draw_step
from tests.models import tiny_model

ROUNDING = 1e-4  # how much a batch moves the logits here (reduced-precision GPU kernels move them as much or more)
PREFIX = list(range(40, 60))  # 20 tokens several prompts share
SEEDED = 12
WARPERS = [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.02), dict(top_p=0.95, top_k=40), dict()]


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 2-17 tokens, every other one after PREFIX."""
    rng = random.Random(seed)
    tails = [[rng.randrange(3, 96) for _ in range(rng.randrange(2, 18))] for _ in range(count)]
    return [PREFIX + tail if i % 2 == 0 else tail for i, tail in enumerate(tails)]


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=16,
        temperature=1.3 + 0.1 * (i % 5),
        seed=1000 + 37 * i,
        ignore_eos=True,
        n=2 if i == 5 else 1,
        **WARPERS[i % len(WARPERS)],
    )


NEIGHBOURS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.5, top_p=0.8, ignore_eos=True),
]

CONFIGS = {
    "batch": dict(max_num_seqs=17, num_blocks=200, block_size=4, enable_prefix_caching=False),
    "preemption": dict(max_num_seqs=17, num_blocks=40, block_size=4, enable_prefix_caching=False),
    "prefix-reuse": dict(
        max_num_seqs=17, num_blocks=200, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=40
    ),
    # decode steps that draw their tokens inside the step (draw_step), as on CUDA
    "static-steps": dict(max_num_seqs=17, num_blocks=200, block_size=4, enable_prefix_caching=False, cuda_graphs=True),
}


@contextlib.contextmanager
def _rounding() -> Iterator[list[str]]:
    """The engine samples from logits plus ``ROUNDING`` times Gaussian noise, new at every step — in the executor's
    sampling and in the draw inside static decode steps alike. Yields which of the two drew, step by step."""
    steps, drew = itertools.count(), []

    def rounded(logits: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator(logits.device).manual_seed(next(steps))
        return logits + ROUNDING * torch.randn(logits.shape, generator=gen, device=logits.device)  # [R, V]

    def perturbed_sample(logits: torch.Tensor, *args, **kwargs):
        drew.append("sample")
        return sample(rounded(logits), *args, **kwargs)

    def perturbed_draw(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        drew.append("in step")
        return draw_step(rounded(logits), columns)

    with (
        mock.patch("hfaccel.engine.executor.sample", perturbed_sample),
        mock.patch("hfaccel.runner.graphs.draw_step", perturbed_draw),
    ):
        yield drew


@pytest.fixture(scope="module")
def model():
    return hfaccel.accelerate(tiny_model("llama"), attention="torch")


@pytest.fixture(scope="module")
def alone(model) -> list[list[list[int]]]:
    """Each seeded request's completions, run on its own."""
    engine = Engine(model, max_num_seqs=4, num_blocks=64, block_size=4, enable_prefix_caching=False)
    prompts = _prompts(SEEDED, seed=0)
    with _rounding():
        return [[o.token_ids for o in engine.generate([prompts[i]], _seeded(i))[0].outputs] for i in range(SEEDED)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_seeded_requests_give_the_same_tokens_in_any_batch(model, alone, config):
    prompts = _prompts(SEEDED, seed=0)
    others = _prompts(len(NEIGHBOURS), seed=1)
    batch = [(prompts[i], _seeded(i)) for i in range(SEEDED)]
    for j, params in enumerate(NEIGHBOURS):  # neighbours between the seeded requests
        batch.insert(3 * j + 1, (others[j], params))
    with _rounding() as drew:
        outputs = Engine(model, **CONFIGS[config]).generate([p for p, _ in batch], [params for _, params in batch])
    assert ("in step" in drew) == (config == "static-steps")
    seeded = [[o.token_ids for o in out.outputs] for out, (_, params) in zip(outputs, batch) if params.seed]
    assert seeded == alone
    if config == "preemption":
        assert sum(out.metrics.num_preemptions for out in outputs) > 0, "the tiny pool should force preemption"
    if config == "prefix-reuse":
        assert sum(out.metrics.num_cached_tokens for out in outputs) > 0, "shared prefixes should hit the cache"
