"""PagedCache: same tokens as transformers' default cache, on accelerated and plain models; cache API."""

import pytest
import torch
import transformers
from transformers import DynamicCache

import hfaccel
from hfaccel import PagedCache, compat
from hfaccel.kv import PagedKV
from tests.devices import DEVICE
from tests.models import ARCHITECTURES, generate_cache, model_cache, padded_batch, tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _paged_cache(model, rows=3, length=64, **kwargs):
    return PagedCache(model.config, max_batch_size=rows, max_cache_len=length, **kwargs)


@pytest.mark.parametrize("accelerated", [False, True], ids=["plain", "accelerated"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_with_paged_cache_matches_default_cache(arch, accelerated):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=24, **GREEDY)
    if accelerated:
        hfaccel.accelerate(model, attention="triton")
    cache = _paged_cache(model, length=11 + 24)
    got = model.generate(**batch, max_new_tokens=24, **generate_cache(cache), **GREEDY)
    assert torch.equal(got, expected)
    stats = cache.memory_stats()
    # rows of 11, 7 and 4 real tokens plus 23 cached new ones; accelerated, generate() tells the cache the padding
    tokens = [11 + 23, 7 + 23, 4 + 23] if accelerated else [34, 34, 34]
    assert stats["blocks_used"] == sum(-(-n // 16) for n in tokens)
    assert stats["bytes_holding_tokens"] == sum(tokens) * cache.block_bytes() // 16


def _watch_pool_reads(monkeypatch) -> tuple[list, list]:
    """(the (pool, layer) each paged-attention call reads, the PagedCaches whose update runs), filled as they run."""
    import hfaccel.attention.functions as attention

    calls, caches = [], []
    real_paged, real_update = attention.paged_attention_op, PagedCache.update
    monkeypatch.setattr(attention, "paged_attention_op", lambda *a, **k: calls.append(a[1:3]) or real_paged(*a, **k))
    monkeypatch.setattr(PagedCache, "update", lambda self, *a, **k: caches.append(self) or real_update(self, *a, **k))
    return calls, caches


def test_accelerated_generate_reads_the_pool_without_gathering(monkeypatch):
    """Default generate() of an accelerated model: hfaccel's decode loop over the model's KV pool — the paged kernel
    for the packed prefill and every decode step of every layer, reading that pool, no gather, no PagedCache."""
    model = tiny_model("llama")
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=10, **GREEDY)
    hfaccel.accelerate(model, attention="triton")
    calls, caches = _watch_pool_reads(monkeypatch)
    monkeypatch.setattr(
        PagedKV,
        "gather",
        lambda self: (_ for _ in ()).throw(AssertionError("gathered")) if self.dense is None else self.dense,
    )
    got = model.generate(**batch, max_new_tokens=10, **GREEDY)
    assert torch.equal(got, expected)
    assert len(calls) == 10 * model.config.num_hidden_layers  # the prefill and 9 decode steps, every layer
    pool = model.hfaccel.session.runner.pool.tensors[0]  # every call reads one of its layers
    assert all(kv is pool and layer in range(2) for kv, layer in calls) and not caches
    assert str(model.hfaccel.decode) == "hfaccel"


def test_transformers_loop_reads_a_paged_cache_without_gathering(monkeypatch):
    """What hfaccel's loop leaves to transformers' (beam search) runs over a PagedCache, read in place."""
    model = tiny_model("llama")
    batch = padded_batch()
    kwargs = dict(max_new_tokens=6, num_beams=2, **GREEDY)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="triton")
    calls, caches = _watch_pool_reads(monkeypatch)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    assert len(calls) == 5 * model.config.num_hidden_layers  # every decode step of every layer
    assert all(kv is caches[0].pool.tensors[0] and layer in range(2) for kv, layer in calls)
    assert str(model.hfaccel.decode) == "transformers (generation options ['num_beams'])"


@pytest.mark.parametrize("accelerated", [False, True], ids=["plain", "accelerated"])
def test_left_padding_takes_no_slots(accelerated):
    """Told the rows' left padding, a PagedCache read by hfaccel's attention gives padding no slot and no block;
    another attention reads transformers' padded layout, so it keeps it — and memory_stats counts it as waste."""
    model = tiny_model("mistral")  # sliding window 8, shorter than the longest row
    batch = padded_batch((11, 7, 4))
    expected = model.generate(**batch, max_new_tokens=6, **GREEDY)
    if accelerated:
        hfaccel.accelerate(model, attention="torch")
    cache = _paged_cache(model, length=17, block_size=4, left_padding=[0, 4, 7])
    assert torch.equal(model.generate(**batch, max_new_tokens=6, **generate_cache(cache), **GREEDY), expected)
    stats = cache.memory_stats()  # the cache holds the prompts and 5 generated tokens per row
    real = [11 + 5, 7 + 5, 4 + 5]
    held = real if accelerated else [16, 16, 16]
    assert stats["blocks_used"] == sum(-(-n // 4) for n in held)
    assert stats["bytes_holding_tokens"] == sum(real) * cache.block_bytes() // 4


def test_gathering_a_cache_without_padding_gives_transformers_layout():
    """The exact fallbacks that read gathered K/V see cache positions, padding as zeros."""
    model = tiny_model("llama")
    hfaccel.accelerate(model, attention="torch")
    batch = padded_batch((6, 3))
    held, padded = (_paged_cache(model, rows=2, length=8, block_size=4, left_padding=pad) for pad in ([0, 3], None))
    with torch.no_grad():
        for cache in (held, padded):
            model(**batch, **model_cache(model, cache), use_cache=True)
    k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)  # [B, Hkv, 1, D]: one more token, layer 0
    got, expected = held.update(k, v, 0)[0].gather(), padded.update(k, v, 0)[0].gather()
    real = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1).bool()  # [B, S]
    for have, want in zip(got, expected):  # keys, values [B, Hkv, S, D]
        assert have.shape == want.shape
        torch.testing.assert_close(have.transpose(1, 2)[real], want.transpose(1, 2)[real], rtol=0, atol=0)
        assert not have.transpose(1, 2)[~real].any()


@pytest.mark.parametrize("accelerated", [False, True], ids=["plain", "accelerated"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_beam_search_matches(arch, accelerated):
    model = tiny_model(arch)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=12, num_beams=3, **GREEDY)
    expected = model.generate(**batch, **kwargs)
    if accelerated:
        hfaccel.accelerate(model)
    got = model.generate(**batch, **generate_cache(_paged_cache(model, rows=9, length=23)), **kwargs)
    assert torch.equal(got, expected)


def test_beam_search_in_a_pool_sized_exactly_for_the_request():
    """Beams that share a partial last block copy it on write; the default pool (rows x blocks per row) is
    enough because the last sharer keeps the original (blocks_to_append_many counts exactly)."""
    model = tiny_model("llama")
    batch = padded_batch(lengths=(5,))
    kwargs = dict(max_new_tokens=6, num_beams=2, **GREEDY)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="torch")  # generate() sizes the PagedCache: 2 rows x 1 block
    assert torch.equal(model.generate(**batch, **kwargs), expected)


@pytest.mark.parametrize("accelerated", [False, True], ids=["plain", "accelerated"])
def test_sampling_with_seed_matches(accelerated):
    model = tiny_model("qwen2")
    batch = padded_batch()
    kwargs = dict(
        max_new_tokens=16,
        do_sample=True,
        top_k=20,
        temperature=0.8,
        pad_token_id=0,
        eos_token_id=None,
        num_return_sequences=2,
    )
    torch.manual_seed(7)
    expected = model.generate(**batch, **kwargs)
    if accelerated:
        hfaccel.accelerate(model)
    torch.manual_seed(7)
    got = model.generate(**batch, **generate_cache(_paged_cache(model, rows=6, length=27)), **kwargs)
    assert torch.equal(got, expected)


def test_assisted_decoding_matches():
    """Assisted generation: hfaccel's speculative decoding, and transformers' own (batch 1) when the caller
    passes a PagedCache for the target (it crops the cache as drafts are rejected)."""
    model, draft = tiny_model("llama"), tiny_model("llama", seed=5)
    batch = {k: v[:1] for k, v in padded_batch().items()}
    expected = model.generate(**batch, max_new_tokens=16, **GREEDY)
    hfaccel.accelerate(model, attention="triton")
    got = model.generate(**batch, max_new_tokens=16, assistant_model=draft, **GREEDY)
    assert torch.equal(got, expected)
    with pytest.warns(UserWarning, match="transformers' implementation.*'(past_key_values|cache)'"):
        got = model.generate(
            **batch,
            max_new_tokens=16,
            assistant_model=draft,
            **generate_cache(_paged_cache(model, rows=1, length=40)),
            **GREEDY,
        )
    assert torch.equal(got, expected)


def test_request_beyond_max_cache_len_raises_before_any_forward():
    model = hfaccel.accelerate(tiny_model("llama"))
    batch = padded_batch()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    cache = _paged_cache(model, length=20)
    with pytest.raises(ValueError, match="max_cache_len is 20"):
        model.generate(**batch, max_new_tokens=24, **generate_cache(cache), **GREEDY)
    with pytest.raises(ValueError, match="max_batch_size=3"):
        model.generate(**batch, max_new_tokens=4, num_beams=2, **generate_cache(cache), **GREEDY)
    small = _paged_cache(model, length=64, num_blocks=4)
    with pytest.raises(ValueError, match="the pool has 4 free"):
        model.generate(**batch, max_new_tokens=24, **generate_cache(small), **GREEDY)
    assert forwards == []
    # the cache is still usable
    hfaccel.restore(model)
    expected = model.generate(**batch, max_new_tokens=8, **GREEDY)
    hfaccel.accelerate(model)
    assert torch.equal(model.generate(**batch, max_new_tokens=8, **generate_cache(cache), **GREEDY), expected)


def test_plain_model_overflow_raises_clearly_and_keeps_cache_usable():
    """Without accelerate there is no hook before the forward: the first layer's update refuses, unchanged."""
    model = tiny_model("llama")
    batch = padded_batch()
    cache = _paged_cache(model, length=64, num_blocks=2)
    with pytest.raises(ValueError, match="needs 3 more blocks"):
        model.generate(**batch, max_new_tokens=4, **generate_cache(cache), **GREEDY)
    assert cache.manager.num_free_blocks == 2 and cache.rows == []


def _feed(cache, reference, steps, batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = cache.pool.group_shapes[0]
    for length in steps:
        for layer in range(cache.num_layers):
            k = torch.randn(batch, heads, length, dim, generator=gen).to(DEVICE)
            v = torch.randn(batch, heads, length, dim, generator=gen).to(DEVICE)
            reference.update(k, v, layer)
            cache.update(k, v, layer)


def _assert_same(cache, reference):
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer in range(cache.num_layers):
        empty = torch.zeros(
            len(cache.rows), *cache.pool.group_shapes[0][:1], 0, cache.pool.group_shapes[0][1], device=DEVICE
        )
        keys, values = cache.update(empty, empty, layer)
        assert torch.equal(keys, reference.layers[layer].keys)
        assert torch.equal(values, reference.layers[layer].values)


def test_cache_operations_match_dynamic_cache():
    """crop / reorder (beam) / repeat_interleave / select keep the same K/V as DynamicCache, sharing blocks."""
    model = tiny_model("llama")
    cache, reference = _paged_cache(model, rows=6, length=80, block_size=4), DynamicCache(config=model.config)
    _feed(cache, reference, [7, 1, 1, 5])
    _assert_same(cache, reference)
    cache.crop(-3), reference.crop(-3)
    _assert_same(cache, reference)
    used = cache.manager.num_used_blocks
    beam_idx = torch.tensor([2, 2, 0])
    cache.reorder_cache(beam_idx), reference.reorder_cache(beam_idx)
    _assert_same(cache, reference)
    assert cache.manager.num_used_blocks < used  # rows 2 and 2' share blocks; row 1's were freed
    _feed(cache, reference, [1, 3], seed=1)  # appends copy the shared partial block, not the full ones
    _assert_same(cache, reference)
    cache.batch_repeat_interleave(2), reference.batch_repeat_interleave(2)
    _assert_same(cache, reference)
    select = torch.tensor([5, 0, 3])
    cache.batch_select_indices(select), reference.batch_select_indices(select)
    _assert_same(cache, reference)
    cache.manager.check_invariants()
    cache.reset()
    assert cache.manager.num_free_blocks == cache.manager.num_blocks and cache.get_seq_length() == 0


def test_constructor_validation():
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match="max_cache_len or num_blocks"):
        PagedCache(config, max_batch_size=2)
    with pytest.raises(ValueError, match="max_batch_size"):
        PagedCache(config, max_batch_size=0, max_cache_len=8)
    cache = PagedCache(config, max_batch_size=2, max_cache_len=40, device="cpu", dtype=torch.float16)
    kv = cache.pool.tensors[0]
    assert kv.shape == (2, 2, 2 * 3, 16, 2, 16) and kv.dtype == torch.float16
    assert cache.memory_stats()["blocks_free"] == 6


def test_a_dtype_given_alone_is_the_pools_on_the_first_keys_device():
    """``dtype`` without ``device``: the pool is created on the device of the first keys written, in the dtype given
    — keys of another dtype are refused as where both are given, before any slot is reserved, and keys of that dtype
    are then taken."""
    config = tiny_model("llama").config
    cache = PagedCache(config, max_batch_size=3, max_cache_len=40, dtype=torch.float16)
    heads, dim = cache.pool.group_shapes[0]
    keys = torch.randn(3, heads, 5, dim, device=DEVICE)  # [B, Hkv, S, D] fp32
    with pytest.raises(ValueError, match="torch.float16 pool holds torch.float16 keys"):
        cache.update(keys, keys, 0)
    assert cache.pool.tensors[0].dtype == torch.float16 and cache.pool.device == keys.device
    assert cache.get_seq_length() == 0 and cache.manager.num_free_blocks == cache.manager.num_blocks
    got, _ = cache.update(keys.half(), keys.half(), 0)
    assert torch.equal(got, keys.half())


def test_paged_false_keeps_transformers_cache():
    model = hfaccel.accelerate(tiny_model("llama"), paged=False)
    assert not model.hfaccel.paged and "generate" not in vars(model)
    out = model.generate(**padded_batch(), max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    assert isinstance(compat.output_cache(out), transformers.DynamicCache)
    hfaccel.accelerate(model)
    out = model.generate(**padded_batch(), max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    assert isinstance(compat.output_cache(out), PagedCache)
    hfaccel.restore(model)
    assert "generate" not in vars(model)


def test_a_callers_paged_cache_holds_no_padding_or_counts_it_as_waste():
    """The README's example: a PagedCache the caller passes with a left-padded batch. Accelerated, generate() tells
    it the padding, which then takes no block; on transformers' attention the padding is held and counted as waste,
    not as tokens."""
    lengths, new = (11, 7, 4), 5
    model = tiny_model("llama")
    batch = padded_batch(lengths)
    expected = model.generate(**batch, max_new_tokens=new, **GREEDY)
    plain = PagedCache(model.config, max_batch_size=3, max_cache_len=32, block_size=4, left_padding=[0, 4, 7])
    assert torch.equal(model.generate(**batch, max_new_tokens=new, **generate_cache(plain), **GREEDY), expected)
    stats = plain.memory_stats()
    held = 3 * (11 + new - 1)  # every row holds the padded width (the last token's K/V is never written)
    assert stats["bytes_holding_tokens"] == (held - 11) * plain.block_bytes() // 4 and stats["waste_fraction"] > 0
    hfaccel.accelerate(model)
    cache = PagedCache(model.config, max_batch_size=3, max_cache_len=32, block_size=4)
    assert torch.equal(model.generate(**batch, max_new_tokens=new, **generate_cache(cache), **GREEDY), expected)
    real = [n + new - 1 for n in lengths]
    assert cache.memory_stats()["blocks_used"] == sum(-(-n // 4) for n in real)
