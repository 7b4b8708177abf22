"""``accelerate(model, compile=True)`` where hfaccel's kernels do not run (a CPU without the Triton interpreter):
``generate()`` runs transformers' loop — the faster path there — over transformers' own static cache with its decode
forward compiled (on every device, not only CUDA), the tokens of eager transformers; a caller's own choice of cache
or compile settings is kept; a compile failure runs the call again uncompiled and says why."""

import pytest
import torch
from torch._dynamo.utils import counters

import hfaccel
from hfaccel import compat
from tests.models import ARCHITECTURES, padded_batch, tiny_model

GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
COMPILED = "compile=True: its static cache and compiled forward"


@pytest.fixture
def no_triton(monkeypatch):
    """A CPU as a user has it: Triton kernels cannot run (the suite otherwise interprets them)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_compile_on_a_cpu_serves_transformers_compiled_static_path_with_its_tokens(
    no_triton, recompile_limit_per_model, arch
):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = model.generate(**batch, **GREEDY)
    hfaccel.accelerate(model, compile=True)
    before = counters["stats"]["unique_graphs"]
    got = model.generate(**batch, **GREEDY)
    assert torch.equal(got, expected)
    decode = model.hfaccel.decode
    assert decode.path == "transformers" and "faster path on cpu" in decode.reason and COMPILED in decode.reason
    assert counters["stats"]["unique_graphs"] > before  # the decode forward was compiled, not run eagerly


def test_longer_requests_within_the_cache_bucket_compile_nothing_more(no_triton, recompile_limit_per_model):
    """The static cache is sized for the power of two holding the request (>= 256 tokens): a longer prompt or more
    new tokens reuse the cache and its compiled forward."""
    model = hfaccel.accelerate(tiny_model("llama"), compile=True)
    model.generate(**padded_batch(), **GREEDY)
    before = counters["stats"]["unique_graphs"]
    longer = padded_batch((40, 17, 30))
    got = model.generate(**longer, **{**GREEDY, "max_new_tokens": 20})
    assert torch.equal(got, type(model).generate(model, **longer, **{**GREEDY, "max_new_tokens": 20}))
    assert COMPILED in model.hfaccel.decode.reason and counters["stats"]["unique_graphs"] == before


def test_the_callers_cache_and_compile_choices_are_kept(no_triton, recompile_limit_per_model):
    model = hfaccel.accelerate(tiny_model("llama"), compile=True)
    batch = padded_batch()
    expected = type(model).generate(model, **batch, **GREEDY)
    for choice in (dict(cache_implementation="dynamic"), dict(disable_compile=True)):
        before = counters["stats"]["unique_graphs"]
        assert torch.equal(model.generate(**batch, **GREEDY, **choice), expected)
        assert COMPILED not in model.hfaccel.decode.reason and counters["stats"]["unique_graphs"] == before


def test_compile_auto_on_a_cpu_keeps_eager_transformers(no_triton):
    model = hfaccel.accelerate(tiny_model("llama"))
    model.generate(**padded_batch(), **GREEDY)
    assert model.hfaccel.decode.path == "transformers" and COMPILED not in model.hfaccel.decode.reason


def test_a_compile_failure_runs_the_call_uncompiled_and_says_why(
    no_triton, recompile_limit_per_model, monkeypatch, caplog
):
    model = tiny_model("llama")
    batch = padded_batch()
    expected = model.generate(**batch, **GREEDY)
    hfaccel.accelerate(model, compile=True)
    monkeypatch.setattr(
        compat, "compile_config_on_every_device", _failing_to_compile(compat.compile_config_on_every_device)
    )
    with caplog.at_level("WARNING", logger="hfaccel"):
        assert torch.equal(model.generate(**batch, **GREEDY), expected)
        assert torch.equal(model.generate(**batch, **GREEDY), expected)
    reason = model.hfaccel.decode.reason
    # the cause first, then the error torch.compile raised over it
    assert (
        "could not compile (RuntimeError: an inductor failure (made by the test); then BackendCompilerFailed" in reason
        and COMPILED not in reason
    )
    assert sum("could not compile" in record.getMessage() for record in caplog.records) == 1


def _failing_to_compile(compile_config):
    """``compile_config`` with a backend that fails as inductor does on code it cannot compile."""

    def backend(graph, example_inputs):
        raise RuntimeError("an inductor failure (made by the test)")

    def failing():
        config = compile_config()
        config.backend = backend
        return config

    return failing
