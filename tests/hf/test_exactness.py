"""Greedy tokens and logits of accelerate(model) equal transformers' own attention, per architecture.

Runs hfaccel's Triton kernels through the interpreter (tests/conftest.py) and the torch reference path.
fp32 logits: atol 1e-4 (values of magnitude ~10, fp32 accumulation order differs from transformers').
"""

import pytest
import torch

import hfaccel
from tests.models import ARCHITECTURES, padded_batch, tiny_model

NEW_TOKENS = 24


def _generate(model, batch):
    return model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("attention", ["triton", "torch"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_generate_matches_transformers(arch, attention):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = _generate(model, batch)
    hfaccel.accelerate(model, attention=attention)
    assert model.hfaccel.active, model.hfaccel
    got = _generate(model, batch)
    assert torch.equal(got, expected), f"{arch}: accelerated\n{got}\n!= transformers\n{expected}"
    assert str(model.hfaccel.decode) == "hfaccel"  # hfaccel's loop served it, not a silent fallback


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sampled_generate_is_served_by_hfaccels_loop(arch):
    """A plain sampled generate() of every covered architecture runs hfaccel's loop with transformers' draws."""
    model = tiny_model(arch)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=8, do_sample=True, top_p=0.9, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(7)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="torch")
    torch.manual_seed(7)
    got = model.generate(**batch, **kwargs)
    assert str(model.hfaccel.decode) == "hfaccel" and torch.equal(got, expected)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_forward_logits_match_transformers(arch):
    model = tiny_model(arch)
    batch = padded_batch(lengths=(13, 9, 1))
    with torch.no_grad():
        expected = model(**batch).logits
        hfaccel.accelerate(model, attention="triton")
        got = model(**batch).logits
    real = batch["attention_mask"].bool()  # padded positions' logits are meaningless on both paths
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_static_cache_generate_matches(arch):
    model = tiny_model(arch)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="triton")
    assert torch.equal(model.generate(**batch, **kwargs), expected)


def test_sampling_with_seed_matches():
    model = tiny_model("qwen2")
    batch = padded_batch()
    kwargs = dict(max_new_tokens=16, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(123)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model)
    torch.manual_seed(123)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    assert str(model.hfaccel.decode) == "hfaccel"


def test_fp16_generate_matches_reference_path():
    """fp16 Triton kernel vs the torch reference path: same greedy tokens on a model without logit ties."""
    model = tiny_model("llama", dtype=torch.float16)
    batch = padded_batch()
    hfaccel.accelerate(model, attention="torch")
    expected = _generate(model, batch)
    hfaccel.accelerate(model, attention="triton")
    assert torch.equal(_generate(model, batch), expected)


def test_training_mode_gradients_flow():
    model = tiny_model("llama")
    hfaccel.accelerate(model)
    model.train()
    batch = padded_batch()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
