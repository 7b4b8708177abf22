"""The real SmolLM2-135M-Instruct (from its PyPI wheel, see hfaccel.tools.assets): accelerated == plain transformers."""

import copy

import pytest
import torch
import transformers

import hfaccel
from hfaccel.quant.rtn import quantize_rtn
from tests.assets import smollm2_or_skip
from tests.devices import DEVICE
from tests.models import generate_cache

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_or_skip()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        .eval()
        .to(DEVICE)
    )
    return model, tokenizer


def _batch(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)


def _greedy(tokenizer) -> dict:
    return dict(max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def expected(smollm2):
    """Plain transformers' greedy continuations of the batch (the tests below compare against them)."""
    model, tokenizer = smollm2
    return model.generate(**_batch(tokenizer), **_greedy(tokenizer))


def test_greedy_continuations_identical(smollm2, expected):
    model, tokenizer = smollm2
    batch = _batch(tokenizer)
    kwargs = _greedy(tokenizer)
    assert "Paris" in tokenizer.decode(expected[0, batch["input_ids"].shape[1] :])
    hfaccel.accelerate(model, attention="triton")  # paged=True: generate() runs on a PagedCache
    try:
        got = model.generate(**batch, **kwargs)
    finally:
        hfaccel.restore(model)
    assert torch.equal(got, expected), "\n".join(tokenizer.batch_decode(got) + tokenizer.batch_decode(expected))


def test_plain_model_with_paged_cache_identical(smollm2, expected):
    """The real model, not accelerated, generating with an explicit PagedCache (K/V gathered for sdpa)."""
    model, tokenizer = smollm2
    batch = _batch(tokenizer)
    kwargs = _greedy(tokenizer)
    cache = hfaccel.PagedCache(model.config, max_batch_size=3, max_cache_len=batch["input_ids"].shape[1] + 32)
    got = model.generate(**batch, **generate_cache(cache), **kwargs)
    assert torch.equal(got, expected)
    assert cache.memory_stats()["blocks_used"] > 0


def test_prefill_logits_close(smollm2):
    model, tokenizer = smollm2
    batch = _batch(tokenizer)
    with torch.no_grad():
        expected = model(**batch).logits
        hfaccel.accelerate(model, attention="triton")
        try:
            got = model(**batch).logits
        finally:
            hfaccel.restore(model)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-3, rtol=1e-4)


def int4_draft(model, group_size: int = 64):
    """The model with every decoder Linear rounded to int4 (RTN) and dequantized: what an int4 copy computes,
    at fp32 matmul speed on the CPU (the int4 kernels themselves are tested in tests/quant)."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for module in draft.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_rtn(module.weight, group_size).dequantize())
    return draft


def test_speculative_with_an_int4_draft(smollm2, expected):
    """Greedy speculative output is the model's own, stop strings included; the acceptance rate is printed."""
    model, tokenizer = smollm2
    batch = _batch(tokenizer)
    kwargs = _greedy(tokenizer)
    draft = hfaccel.accelerate(int4_draft(model), attention="torch")
    hfaccel.accelerate(model, attention="torch")
    try:
        got, stats = hfaccel.speculative_generate(
            model, draft, **batch, num_draft_tokens=4, return_stats=True, **kwargs
        )
        stopped = hfaccel.speculative_generate(
            model, draft, **batch, stop_strings=[".", "\n\n"], tokenizer=tokenizer, **kwargs
        )
    finally:
        hfaccel.restore(model)
    print(f"SmolLM2-135M with an int4 (RTN, g=64) copy as draft: {stats}")
    assert torch.equal(got, expected), "\n".join(tokenizer.batch_decode(got) + tokenizer.batch_decode(expected))
    assert stats.proposed > 0
    expected_stop = model.generate(**batch, stop_strings=[".", "\n\n"], tokenizer=tokenizer, **kwargs)
    assert torch.equal(stopped, expected_stop), "\n".join(
        tokenizer.batch_decode(stopped) + tokenizer.batch_decode(expected_stop)
    )


ENGINE_PROMPTS = PROMPTS + ["The three primary colors are", "In 1969, the first person to walk on the Moon was"]


@pytest.fixture(scope="module")
def expected_alone(smollm2) -> list[list[int]]:
    """Each of ``ENGINE_PROMPTS``' greedy continuation by plain transformers, generated alone (24 tokens)."""
    model, tokenizer = smollm2
    expected = []
    for prompt in ENGINE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(DEVICE)
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, ids.shape[1] :].tolist())
    return expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_greedy_equals_generate(smollm2, expected_alone, async_scheduling):
    """The engine (chunked prefill, a pool small enough to preempt) gives each prompt its own generate()."""
    model, tokenizer = smollm2
    prompts, expected = ENGINE_PROMPTS, expected_alone
    hfaccel.accelerate(model, attention="torch", paged=False)
    try:
        engine = hfaccel.Engine(
            model, tokenizer, max_num_seqs=4, num_blocks=6, max_num_batched_tokens=24, async_scheduling=async_scheduling
        )
        outputs = engine.generate(prompts, hfaccel.SamplingParams(max_tokens=24, temperature=0))
    finally:
        hfaccel.restore(model)
    for out, want in zip(outputs, expected):
        assert out.outputs[0].token_ids == want, (out.outputs[0].text, tokenizer.decode(want))
        assert out.outputs[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0
