"""The Engine with an fp8 KV cache (``kv_cache_dtype="fp8"``): keys and values stored in e4m3 with per-KV-head scales,
half the bytes of a 16-bit pool — twice the sequences in the same memory — read back by the paged attention; and a
``PagedCache`` in fp8 under plain transformers."""

import pytest
import torch

import hfaccel
from hfaccel.tools.cli import build_parser
from tests.models import generate_cache, tiny_model

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
    compiled = hfaccel.Engine(model, num_blocks=32, max_num_seqs=4, kv_cache_dtype=torch.float8_e4m3fn,
                              cuda_graphs=True, compile=True)
    assert _tokens(compiled) == expected
    assert compiled.stats()["decode_steps"].startswith("compiled")
    shared = [[7, 8, 9, 10] * 8 + [11 + i] for i in range(3)]  # a 32-token prefix: two full blocks, read back
    computed = _tokens(eager, shared[:1])
    hits = eager.generate(shared, GREEDY)
    assert [o.metrics.num_cached_tokens for o in hits] == [32, 32, 32]
    assert [o.outputs[0].token_ids for o in hits] == [*computed, *_tokens(hfaccel.Engine(
        model, num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp8", enable_prefix_caching=False), shared[1:])]


def test_fp8_pool_holds_twice_the_sequences_of_a_bf16_pool_in_the_same_memory(monkeypatch):
    """The same kv_cache_memory: the fp8 pool has twice the blocks of the bf16 one, so eight requests that preempt
    each other in bf16 all run at once in fp8 (the pool's sizing, on the torch path: kernels are tested above)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama", dtype=torch.bfloat16)
    prompts = [[7, 8, 9, 10] * 2 + [11 + i] for i in range(8)]  # one block each, two once they have their tokens
    params = hfaccel.SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    memory = hfaccel.Engine(model, num_blocks=8, max_num_seqs=8).stats()["kv_cache_bytes"]
    bf16 = hfaccel.Engine(model, kv_cache_memory=memory, max_num_seqs=8, enable_prefix_caching=False)
    fp8 = hfaccel.Engine(model, kv_cache_memory=memory, max_num_seqs=8, kv_cache_dtype="fp8",
                         enable_prefix_caching=False)
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
