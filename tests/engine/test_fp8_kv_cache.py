"""The Engine with an fp8 KV cache (``kv_cache_dtype="fp8"``): keys and values stored in e4m3 with per-KV-head scales,
half the bytes of a 16-bit pool — twice the sequences in the same memory — read back by the paged attention; and a
``PagedCache`` in fp8 under plain transformers."""

import json

import pytest
import torch

import hfaccel
from hfaccel.kernels.write_kv import FP8_MAX
from hfaccel.kv.fp8 import HEADROOM
from hfaccel.tools.cli import build_parser
from tests.models import generate_cache, padded_batch, tiny_model

GREEDY = hfaccel.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 33, 9)]


def _tokens(engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, params)
    assert [o.error for o in outputs] == [None] * len(prompts)
    return [o.outputs[0].token_ids for o in outputs]


def test_fp8_pool_gives_the_tokens_of_the_models_own_dtype():
    """A tiny fp32 Llama: the fp8 pool (a quarter of the bytes) gives the tokens the fp32 pool gives — eager steps,
    and the compiled static decode steps (the same tokens as the eager ones); its pool and stats say fp8; prompts
    sharing a prefix take its fp8 blocks from the prefix cache and give the tokens computed whole."""
    model = tiny_model("llama")
    expected = _tokens(hfaccel.Engine(model, num_blocks=32, max_num_seqs=4))
    eager = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8")
    assert _tokens(eager) == expected
    assert eager.runner.pool.tensors[0].dtype == torch.float8_e4m3fn
    stats = eager.stats()
    assert stats["kv_cache_dtype"] == "torch.float8_e4m3fn" and stats["blocks_used"] == 0
    fp32_bytes = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4).stats()["kv_cache_bytes"]
    assert stats["kv_cache_bytes"] * 4 == fp32_bytes
    compiled = hfaccel.Engine(
        model, num_blocks=32, max_num_seqs=4, kv_cache_dtype=torch.float8_e4m3fn, cuda_graphs=True, compile=True
    )
    assert _tokens(compiled) == expected
    assert compiled.stats()["decode_steps"].startswith("compiled")
    shared = [[7, 8, 9, 10] * 8 + [11 + i] for i in range(3)]  # a 32-token prefix: two full blocks, read back
    computed = _tokens(eager, shared[:1])
    hits = eager.generate(shared, GREEDY)
    assert [o.metrics.num_cached_tokens for o in hits] == [32, 32, 32]
    assert [o.outputs[0].token_ids for o in hits] == [
        *computed,
        *_tokens(
            hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", enable_prefix_caching=False),
            shared[1:],
        ),
    ]


def test_fp8_pool_holds_twice_the_sequences_of_a_bf16_pool_in_the_same_memory(monkeypatch):
    """The same kv_cache_memory: the fp8 pool has twice the blocks of the bf16 one, so eight requests that preempt
    each other in bf16 all run at once in fp8 (the pool's sizing, on the torch path: kernels are tested above)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama", dtype=torch.bfloat16)
    prompts = [[7, 8, 9, 10] * 2 + [11 + i] for i in range(8)]  # one block each, two once they have their tokens
    params = hfaccel.SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    memory = hfaccel.Engine(model, num_blocks=8, max_num_seqs=8).stats()["kv_cache_bytes"]
    bf16 = hfaccel.Engine(model, kv_cache_memory=memory, max_num_seqs=8, enable_prefix_caching=False)
    fp8 = hfaccel.Engine(
        model, kv_cache_memory=memory, max_num_seqs=8, kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    assert fp8.stats()["blocks_total"] == 2 * bf16.stats()["blocks_total"] == 16
    assert sum(o.metrics.num_preemptions for o in bf16.generate(prompts, params)) > 0
    outputs = fp8.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) == 0
    assert fp8.stats()["blocks_used"] == 0


def test_bad_kv_cache_dtypes_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        hfaccel.Engine(model, num_blocks=8, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        hfaccel.Engine(model, num_blocks=8, kv_cache_dtype=torch.int8)


def test_serve_takes_kv_cache_dtype():
    args = build_parser().parse_args(["serve", "some/model", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"


@pytest.mark.parametrize("flag", [[], ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]], ids=str)
def test_serve_builds_its_engine_on_the_kv_cache_dtype_it_is_given(flag):
    """The engine ``hfaccel serve`` builds from its arguments (serving._engine, in-process) stores K/V in fp8 when
    told to, a quarter of the fp32 model's bytes per block, and its stats say so; without the flag, the model's
    dtype."""
    from hfaccel.tools import serving

    args = build_parser().parse_args(["serve", "some/model", "--num-blocks", "8", "--max-num-seqs", "2", *flag])
    engine = serving._engine(args, tiny_model("llama"), None)
    try:
        dtype = torch.float8_e4m3fn if flag else torch.float32
        assert engine.runner.pool.tensors[0].dtype == dtype
        stats = engine.stats()
        assert stats["kv_cache_dtype"] == str(dtype) and stats["blocks_total"] == 8
        assert stats["kv_cache_bytes"] == 8 * engine.runner.pool.block_bytes(torch.float32) // (4 if flag else 1)
    finally:
        engine.close()


def test_paged_cache_in_fp8_under_plain_transformers():
    """``PagedCache(dtype=torch.float8_e4m3fn)`` passed to a plain model's generate: K/V stored in fp8 (the pool's
    compute dtype taken from the first keys), read back dequantized — transformers' tokens for this model."""
    model = tiny_model("llama")
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = model.generate(**batch, **kwargs)
    cache = hfaccel.PagedCache(model.config, max_batch_size=1, max_cache_len=16, dtype=torch.float8_e4m3fn)
    assert torch.equal(model.generate(**batch, **generate_cache(cache), **kwargs), expected)
    assert cache.pool.tensors[0].dtype == torch.float8_e4m3fn and cache.pool.dtype == torch.float32
    assert cache.memory_stats()["kv_cache_dtype"] == "torch.float8_e4m3fn"


def test_paged_cache_memory_stats_say_the_kv_dtype():
    """``memory_stats()`` says the pool's K/V dtype (as ``Engine.stats()`` does): an fp8 cache's pool takes half the
    bytes of a bf16 one for the same tokens; a cache taking the first keys' dtype has none until they come."""
    config = tiny_model("llama").config
    fp8 = hfaccel.PagedCache(config, max_batch_size=2, max_cache_len=40, dtype=torch.float8_e4m3fn)
    bf16 = hfaccel.PagedCache(config, max_batch_size=2, max_cache_len=40, device="cpu", dtype=torch.bfloat16)
    lazy = hfaccel.PagedCache(config, max_batch_size=2, max_cache_len=40)
    assert fp8.memory_stats()["kv_cache_dtype"] == "torch.float8_e4m3fn"
    assert bf16.memory_stats()["kv_cache_dtype"] == "torch.bfloat16"
    assert fp8.memory_stats()["bytes_pool"] * 2 == bf16.memory_stats()["bytes_pool"] > 0
    assert lazy.memory_stats()["kv_cache_dtype"] is None


def _prompt_kv_scales(model, prompt: list[int]) -> dict[int, torch.Tensor]:
    """``{layer: [2, Hkv]}``: ``HEADROOM x amax / 448`` of the keys and values transformers computes for ``prompt``."""
    cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    scales = {}
    for layer in range(model.config.num_hidden_layers):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values  # [1, Hkv, S, D]
        amax = torch.stack([keys, values]).abs().amax(dim=(1, 3, 4))  # [2, Hkv]
        scales[layer] = amax * HEADROOM / FP8_MAX
    return scales


def test_prefill_scales_come_from_each_layers_first_prefill(monkeypatch):
    """``kv_scales="prefill"``: each layer's per-head scales are set by the first prefill the pool stores (from the
    prompt's own keys and values, with headroom), then stay; the tokens are the fp32 pool's, eager and compiled
    (the torch path: the Triton 3.9 interpreter's fp32 -> e4m3 drops the carry, 7.9 -> 4, which the values of
    fitted scales reach; the kernels have their own tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama")
    prompt = PROMPTS[1]
    expected = _tokens(hfaccel.Engine(model, num_blocks=32, max_num_seqs=4), [prompt])
    engine = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", kv_scales="prefill")
    assert torch.equal(engine.runner.pool.scales[0], torch.ones_like(engine.runner.pool.scales[0]))
    assert _tokens(engine, [prompt]) == expected
    wanted = _prompt_kv_scales(model, prompt)
    scales = engine.runner.pool.scales[0]  # [L, 2, Hkv]: one group, every layer
    for layer, layer_scales in wanted.items():
        torch.testing.assert_close(scales[layer], layer_scales, rtol=1e-5, atol=0)
    kept = scales.clone()
    assert _tokens(engine) == _tokens(hfaccel.Engine(model, num_blocks=32, max_num_seqs=4))
    assert torch.equal(engine.runner.pool.scales[0], kept)  # the first prefill's, whatever came after
    compiled = hfaccel.Engine(
        model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", kv_scales="prefill", cuda_graphs=True, compile=True
    )
    assert _tokens(compiled, [prompt]) == expected
    assert compiled.stats()["decode_steps"].startswith("compiled")
    torch.testing.assert_close(compiled.runner.pool.scales[0], kept, rtol=1e-5, atol=0)


def test_given_scales_quantize_by_them(monkeypatch):
    """A number is every layer's and head's scale; values past ``448 x scale`` saturate, so a scale far too small
    changes the tokens where the fitting one keeps them (the pool's plumbing, on the torch path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama")
    expected = _tokens(hfaccel.Engine(model, num_blocks=32, max_num_seqs=4))
    fitting = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", kv_scales=0.5)
    assert bool((fitting.runner.pool.scales[0] == 0.5).all())
    assert _tokens(fitting) == expected
    saturating = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", kv_scales=1e-4)
    assert _tokens(saturating) != expected


def test_bad_kv_scales_are_refused():
    model = tiny_model("llama")
    for bad in (0.0, -1.0, float("nan"), "calibrate", True):
        with pytest.raises(ValueError, match="kv_scales must be None"):
            hfaccel.Engine(model, num_blocks=8, kv_cache_dtype="fp8", kv_scales=bad)
    with pytest.raises(ValueError, match="needs an fp8 pool"):
        hfaccel.Engine(model, num_blocks=8, kv_scales="prefill")
    with pytest.raises(ValueError, match="expected 1 or 2"):
        hfaccel.Engine(model, num_blocks=8, kv_cache_dtype="fp8", kv_scales={0: torch.ones(2, 3)})
    args = build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "fp8", "--kv-scales", "prefill"])
    assert args.kv_scales == "prefill"
    assert build_parser().parse_args(["serve", "m", "--kv-scales", "0.25"]).kv_scales == 0.25
    assert build_parser().parse_args(["serve", "m", "--kv-scales", "checkpoint"]).kv_scales is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--kv-scales", "big"])


def test_a_checkpoints_kv_scales_are_read_and_used(tmp_path, monkeypatch):
    """A compressed-tensors fp8 checkpoint with a ``kv_cache_scheme`` (the scheme as compressed-tensors writes it,
    ``self_attn.k_scale`` / ``v_scale`` per tensor): ``load_quantized`` keeps the scales on the attention modules and
    an fp8 pool over the model takes them (on the torch path); a scheme that is not fp8 is refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from compressed_tensors.quantization import QuantizationArgs
    from safetensors.torch import load_file, save_file

    path = hfaccel.save_quantized(hfaccel.quantize(tiny_model("llama"), "fp8"), tmp_path / "fp8kv", format="fp8")
    config = json.loads((path / "config.json").read_text())
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    config["quantization_config"]["kv_cache_scheme"] = scheme.model_dump()
    (path / "config.json").write_text(json.dumps(config))
    shard = next(path.glob("*.safetensors"))
    state = load_file(shard)
    for layer in range(config["num_hidden_layers"]):
        state[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.03 * (layer + 1)], dtype=torch.bfloat16)
        state[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.05 * (layer + 1)], dtype=torch.bfloat16)
    save_file(state, shard, metadata={"format": "pt"})
    model = hfaccel.load_quantized(path, dtype=torch.float32)
    assert model.model.layers[1].self_attn.k_scale.dtype == torch.float32
    engine = hfaccel.Engine(model, num_blocks=16, max_num_seqs=2, kv_cache_dtype="fp8")
    scales = engine.runner.pool.scales[0]  # [L, 2, Hkv]
    for layer in range(config["num_hidden_layers"]):
        k, v = (state[f"model.layers.{layer}.self_attn.{n}_scale"].float() for n in "kv")
        assert torch.equal(scales[layer, 0], k.expand(scales.shape[-1]))
        assert torch.equal(scales[layer, 1], v.expand(scales.shape[-1]))
    assert _tokens(engine) == _tokens(hfaccel.Engine(model, num_blocks=16, max_num_seqs=2))
    config["quantization_config"]["kv_cache_scheme"] = {**scheme.model_dump(), "type": "int"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="reads fp8 KV cache scales"):
        hfaccel.load_quantized(path, dtype=torch.float32)


def test_accelerated_generate_stores_kv_in_fp8_on_every_path():
    """``accelerate(kv_cache_dtype="fp8")``: generate()'s decode loop, the transformers loop over a PagedCache a
    beam search falls back to, and assisted generation all run on fp8 pools and give the tokens of the model's own
    dtype; model.hfaccel says so. Settings that cannot apply are refused before anything changes."""
    plain = tiny_model("llama")
    batch = padded_batch()
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = plain.generate(**batch, **greedy)
    beams = plain.generate(**batch, **greedy, num_beams=2)
    model = hfaccel.accelerate(tiny_model("llama"), kv_cache_dtype="fp8", compile=False)
    assert torch.equal(model.generate(**batch, **greedy), expected)
    assert str(model.hfaccel.decode) == "hfaccel"
    assert model.hfaccel.session.runner.pool.tensors[0].dtype == torch.float8_e4m3fn
    assert "paged KV cache in float8_e4m3fn" in str(model.hfaccel)
    out = model.generate(**batch, **greedy, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, beams)
    assert model.hfaccel.decode.path == "transformers"
    assert out.past_key_values.pool.tensors[0].dtype == torch.float8_e4m3fn
    assisted = model.generate(**batch, **greedy, assistant_model=tiny_model("llama"))
    assert torch.equal(assisted, expected)
    runners = model.hfaccel.session.speculative
    assert runners.target.pool.cache_dtype == runners.draft.pool.cache_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="paged=True"):
        hfaccel.accelerate(tiny_model("llama"), paged=False, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs an fp8 KV pool"):
        hfaccel.accelerate(tiny_model("llama"), kv_scales=0.5)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        hfaccel.accelerate(tiny_model("llama"), kv_cache_dtype="int8")


def test_paged_cache_with_prefill_scales(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as test_prefill_scales_come_from_each_layers_first_prefill
    model = tiny_model("llama")
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    kwargs = dict(max_new_tokens=8, do_sample=False)
    expected = model.generate(**batch, **kwargs)
    cache = hfaccel.PagedCache(
        model.config, max_batch_size=1, max_cache_len=16, dtype=torch.float8_e4m3fn, kv_scales="prefill"
    )
    assert torch.equal(model.generate(**batch, **generate_cache(cache), **kwargs), expected)
    wanted = _prompt_kv_scales(model, batch["input_ids"][0].tolist())
    for layer, layer_scales in wanted.items():
        torch.testing.assert_close(cache.pool.scales[0][layer], layer_scales, rtol=1e-5, atol=0)
