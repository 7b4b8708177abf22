"""Models whose transformers code depends on data: Phi-3 longrope (its RoPE factors switch once a sequence passes
``original_max_position_embeddings``: ``torch.max(position_ids)`` then a Python branch on transformers 5.17) and
Mixtral (expert loops over ``nonzero``). hfaccel's loop serves them with transformers' tokens; compiled, they either
compile (and on a GPU capture) or run the uncompiled step with a one-line reason — never a crash, never silently.
"""

import pytest
import torch

import hfaccel
from tests.models import DATA_DEPENDENT_ARCHITECTURES, padded_batch, tiny_model

# the longest row passes Phi-3's original_max_position_embeddings (64) while it decodes
KWARGS = dict(max_new_tokens=60, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("arch", sorted(DATA_DEPENDENT_ARCHITECTURES))
def test_greedy_tokens_equal_transformers_from_hfaccels_loop(arch):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = model.generate(**batch, **KWARGS)
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, **KWARGS), expected)
    assert str(model.hfaccel.decode) == "hfaccel"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DATA_DEPENDENT_ARCHITECTURES))
def test_compiled_they_compile_or_say_in_one_line_why_not(arch):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = model.generate(**batch, **KWARGS)
    hfaccel.accelerate(model, attention="torch", compile=True)
    assert torch.equal(model.generate(**batch, **KWARGS), expected)
    assert str(model.hfaccel.decode) == "hfaccel"
    graphs = model.hfaccel.session.runner.graphs
    if not graphs.compiled:
        reason = graphs.compile_failure
        assert reason and "\n" not in reason and reason in str(model.hfaccel), model.hfaccel
