"""torch.compile of an accelerated model: fullgraph traces (no graph break) in prefill and decode, equal to eager;
transformers' own static cache + compile generate path, equal to sdpa. Inductor on the CPU; the models run the
torch reference kernels (custom ops are opaque to inductor either way)."""

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache, masking_utils

import hfaccel
from hfaccel import compat
from tests.devices import DEVICE
from tests.models import model_cache, padded_batch, tiny_model

pytestmark = pytest.mark.slow
ARCHS = ["llama", "qwen2", "gemma2"]  # gemma2: sliding window + softcap; qwen2: a sliding and a full layer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles the models' shared transformers code afresh (dynamo's recompile limit is per code object,
    and every test here compiles a new model through the same code)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _next_inputs(batch: dict, logits: torch.Tensor) -> dict:
    """One decode step's inputs after a left-padded prefill."""
    mask = torch.cat([batch["attention_mask"], batch["attention_mask"].new_ones(len(logits), 1)], 1)
    return dict(
        input_ids=logits[:, -1].argmax(-1, keepdim=True), attention_mask=mask, position_ids=mask.cumsum(1)[:, -1:] - 1
    )


@pytest.mark.parametrize("cache_type", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fullgraph_compile_equals_eager_in_prefill_and_decode(arch, cache_type):
    model = tiny_model(arch)
    hfaccel.accelerate(model, attention="torch")
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises

    def cache():
        if cache_type == "dynamic":
            return DynamicCache(config=model.config)
        return StaticCache(config=model.config, max_cache_len=16)

    batch = padded_batch()
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        eager_cache, compiled_cache = cache(), cache()
        expected = model(**batch, **model_cache(model, eager_cache), use_cache=True).logits
        got = compiled(**batch, **model_cache(model, compiled_cache), use_cache=True).logits
        torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
        step = _next_inputs(batch, expected)
        expected = model(**step, **model_cache(model, eager_cache), use_cache=True).logits
        got = compiled(**step, **model_cache(model, compiled_cache), use_cache=True).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the SDPA route serves 16-bit calls on CUDA only")
def test_fullgraph_compile_through_the_sdpa_route():
    """An unpadded 16-bit prefill on CUDA takes the SDPA route, whose choice reads the tuned table: inside a trace
    the route is decided without it, with no graph break."""
    model = tiny_model("llama", dtype=torch.float16)
    hfaccel.accelerate(model)
    ids = torch.randint(3, 96, (2, 37), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        got = torch.compile(model, fullgraph=True)(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_compiled_generate_equals_sdpa(arch):
    """transformers' static cache + torch.compile path (what it auto-compiles on CUDA), on an accelerated model:
    greedy tokens of a left-padded batch of 3 equal the unaccelerated model's."""
    model = tiny_model(arch)
    batch = padded_batch()
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # transformers auto-compiles only on accelerators otherwise
    kwargs = dict(
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        cache_implementation="static",
        compile_config=config,
    )
    expected = model.generate(**batch, **{**kwargs, "compile_config": None})
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    assert str(model.hfaccel.decode) == "transformers (generation options ['cache_implementation'])"


def test_mask_functions_traced_by_dynamo_are_recognised_from_the_config():
    """Inside a trace a mask function's closure cannot be read: a causal sliding window is recognised from the
    config transformers passes (as eagerly from the closure), and chunked attention (the other and_masks pattern
    given a local_size) still goes to the dense path."""
    import copy

    config = copy.deepcopy(tiny_model("gemma2").config)
    config.attention_chunk_size = 5  # as a chunked-attention model's config holds it
    window = config.sliding_window

    @torch.compile(fullgraph=True)
    def describe(x, chunked: bool):
        if chunked:
            function, size = masking_utils.chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long)), 5
        else:
            function, size = masking_utils.sliding_window_causal_mask_function(window), window
        return x + 1, compat.describe_mask_function(function, size, config)

    eager = compat.describe_mask_function(masking_utils.sliding_window_causal_mask_function(window), window, config)
    assert describe(torch.zeros(1), False)[1] == eager == compat.MaskPattern(causal=True, sliding_window=window)
    assert describe(torch.zeros(1), True)[1] is None
