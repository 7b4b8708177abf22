"""paged_attention / write_kv (Triton, interpreted; the batched torch backend) vs their references; split-K; sm_90
compilation."""

import importlib

import pytest
import torch

from hfaccel.kernels.paged_attention import (
    PagedConfig,
    candidate_paged_configs,
    choose_num_splits,
    combine_warps,
    default_paged_config,
    paged_attention,
    paged_attention_reference,
)
from hfaccel.kernels.write_kv import dequantize_kv, quantize_kv, write_kv, write_kv_reference
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, assert_close, assert_each_compiles_for_sm90, launch_like

paged_module = importlib.import_module("hfaccel.kernels.paged_attention")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZE = 16


def _pool(num_blocks, heads_kv, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, heads_kv, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _tables(lengths, num_blocks, seed=0):
    """Shuffled, non-contiguous block tables (padded with a wide stride) for sequences of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(-(-n // BLOCK_SIZE) for n in lengths) + 3
    storage = torch.full((len(lengths), width * 2), -1, dtype=torch.int32)
    tables = storage[:, ::2]  # a non-contiguous view
    used = 0
    for row, n in enumerate(lengths):
        count = -(-n // BLOCK_SIZE)
        tables[row, :count] = perm[used : used + count].to(torch.int32)
        used += count
    return tables, torch.tensor(lengths, dtype=torch.int32)


LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim", [((4, 4), 64), ((8, 2), 80), ((6, 2), 128), ((8, 1), 256), ((4, 2), 512)], ids=lambda v: str(v)
)
def test_decode_matches_reference(heads, head_dim, dtype):
    k_pool, v_pool = _pool(64, heads[1], head_dim, dtype)
    tables, lens = _tables(LENGTHS, 64)
    q = torch.randn(len(LENGTHS), heads[0], 1, head_dim).to(dtype)
    out = on_device(paged_attention, q, k_pool, v_pool, tables, lens, backend="triton", num_splits=1)
    assert out.shape == (len(LENGTHS), 1, heads[0], head_dim)
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_decode_and_prefill_chunks(dtype):
    """Packed batch: decode tokens next to prefill chunks that attend to earlier blocks of their sequence."""
    q_lens = [1, 7, 1, 33, 17]
    seq_lens = [1, 40, 300, 33, 120]  # chunk of 7 after 33 cached tokens; a whole 33-token prompt; ...
    k_pool, v_pool = _pool(64, 2, 64, dtype)
    tables, lens = _tables(seq_lens, 64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 8, 64).to(dtype)
    out = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=max(q_lens),
        backend="triton",
        num_splits=1,
    )
    assert out.shape == q.shape
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu))


@pytest.mark.parametrize("splits", [1, 3])
def test_padding_rows_of_a_static_decode_batch(splits):
    """Rows of length 0 and slot -1 (a CUDA-graph batch padded to a ladder size) return zeros, and the real
    rows beside them are unaffected."""
    k_pool, v_pool = _pool(32, 2, 64, torch.float32)
    tables, lens = _tables([40, 17, 1, 1], 32)
    lens[2:] = 0
    tables[2:] = 0
    q = torch.randn(4, 8, 64)
    cu = torch.arange(5, dtype=torch.int32)
    out = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=1,
        max_seqlen_k=256,
        backend="triton",
        num_splits=splits,
    )
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_agrees_with_single_pass(dtype):
    k_pool, v_pool = _pool(128, 2, 64, dtype)
    tables, lens = _tables([1200, 5, 700], 128)
    q = torch.randn(3, 8, 1, 64).to(dtype)
    single = on_device(paged_attention, q, k_pool, v_pool, tables, lens, backend="triton", num_splits=1)
    split = on_device(paged_attention, q, k_pool, v_pool, tables, lens, backend="triton", num_splits=5)
    assert_close(split, single)
    assert_close(split, paged_attention_reference(q, k_pool, v_pool, tables, lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_prefill_with_padding_window_softcap_and_splits(dtype):
    """generate()-style dense queries with left padding (key_mask), sliding window and softcap."""
    k_pool, v_pool = _pool(64, 2, 64, dtype)
    tables, lens = _tables([140, 140, 140], 64)
    key_mask = torch.ones(3, 300, dtype=torch.bool)[:, ::2]  # non-contiguous columns
    key_mask[1, :30] = False
    key_mask[2, :137] = False
    q = torch.randn(3, 4, 9, 64).to(dtype)  # the last 9 tokens of each sequence
    kwargs = dict(key_mask=key_mask, sliding_window=50, softcap=20.0)
    expected = paged_attention_reference(q, k_pool, v_pool, tables, lens, **kwargs)
    for splits in (1, 3):
        out = on_device(paged_attention, q, k_pool, v_pool, tables, lens, backend="triton", num_splits=splits, **kwargs)
        assert torch.isfinite(out).all()
        assert_close(out, expected)


def test_split_count_fills_the_sms():
    """Programs x splits cover the 132 SMs of an H100 once where the context allows (>= 128 keys per split), no
    split is left empty by rounding its key range to whole blocks, and enough programs need no split."""
    assert choose_num_splits(num_programs=8, max_seqlen_k=4096, block_n=64, num_sms=132) == 16  # batch 1, 8 KV heads
    assert choose_num_splits(num_programs=8, max_seqlen_k=1024, block_n=64, num_sms=132) == 8  # 128 keys each
    assert choose_num_splits(num_programs=64, max_seqlen_k=4096, block_n=64, num_sms=132) == 3  # batch 8
    assert choose_num_splits(num_programs=512, max_seqlen_k=32768, block_n=64, num_sms=132) == 1  # batch 64
    assert choose_num_splits(num_programs=8, max_seqlen_k=200, block_n=64, num_sms=132) == 1
    for programs in (1, 2, 8, 24, 64, 131):
        for context in (256, 1000, 4096, 32768, 131072):
            splits = choose_num_splits(programs, context, 64, 132)
            per_split = paged_module._keys_per_split(context, splits, 64)
            assert 1 <= splits <= paged_module.MAX_SPLITS and (splits - 1) * per_split < context
            if splits < paged_module.MAX_SPLITS and context >= 132 * paged_module.MIN_KEYS_PER_SPLIT:
                assert programs * splits >= 132 - programs, (programs, context, splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chosen_splits_match_reference_and_are_deterministic(dtype):
    """A decode over a long context with the split count the launch chooses (2 programs on 132 SMs: 9 splits of at
    least 128 keys, 7 or 8 once rounded to whole blocks), then combined; the same call twice gives the same bits."""
    k_pool, v_pool = _pool(96, 2, 64, dtype)
    tables, lens = _tables([1200, 3], 96)
    plan = paged_module.plan_launch(2, 2, 4, 1, 1200, 64, dtype, "cpu")
    assert plan.num_splits == (8 if dtype == torch.float32 else 7)  # blocks of 32 / 64 keys
    q = torch.randn(2, 8, 1, 64).to(dtype)
    first = on_device(paged_attention, q, k_pool, v_pool, tables, lens, max_seqlen_k=1200, backend="triton")
    again = on_device(paged_attention, q, k_pool, v_pool, tables, lens, max_seqlen_k=1200, backend="triton")
    assert torch.equal(first, again)
    assert_close(first, paged_attention_reference(q, k_pool, v_pool, tables, lens))


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_block_loop_with_small_tiles(dtype, splits):
    """Tiles of 16 keys: windows and attention chunks that cut blocks, a prefill chunk's diagonal, a key mask, splits
    over all that."""
    config = PagedConfig(16, 16, 4, 1)
    q_lens, seq_lens = [1, 11, 1, 30], [250, 90, 17, 30]
    k_pool, v_pool = _pool(64, 2, 64, dtype)
    tables, lens = _tables(seq_lens, 64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, 64).to(dtype)
    for kwargs in (dict(sliding_window=37, softcap=15.0), dict(), dict(chunk_size=23)):
        out = on_device(
            paged_attention,
            q,
            k_pool,
            v_pool,
            tables,
            lens,
            cu_seqlens_q=cu,
            max_seqlen_q=30,
            max_seqlen_k=250,
            backend="triton",
            num_splits=splits,
            config=config,
            **kwargs,
        )
        assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, **kwargs))
    key_mask = torch.ones(4, 250, dtype=torch.bool)
    key_mask[0, :70] = False
    dense_q = torch.randn(4, 6, 1, 64).to(dtype)
    out = on_device(
        paged_attention,
        dense_q,
        k_pool,
        v_pool,
        tables,
        lens,
        max_seqlen_k=250,
        backend="triton",
        num_splits=splits,
        config=config,
        key_mask=key_mask,
    )
    assert_close(out, paged_attention_reference(dense_q, k_pool, v_pool, tables, lens, key_mask=key_mask))


@pytest.mark.parametrize(
    "config",
    [c for d in (64, 128, 256, 512) for c in candidate_paged_configs(d, torch.float16, 4)],
    ids=lambda c: f"n{c.block_n}w{c.num_warps}s{c.num_stages}",
)
def test_every_tunable_decode_config_matches_reference(config):
    head_dim = next(d for d in (128, 256, 512) if config in candidate_paged_configs(d, torch.float16, 4))
    k_pool, v_pool = _pool(48, 2, head_dim, torch.float16)
    tables, lens = _tables([300, 41], 48)
    q = torch.randn(2, 8, 1, head_dim).half()
    out = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        max_seqlen_k=300,
        backend="triton",
        num_splits=2,
        config=config,
    )
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens))


def test_tuned_table_sets_decode_tiles_and_splits(tuned_table, monkeypatch):
    monkeypatch.setattr(paged_module, "num_sms", lambda device: 132)  # the "cuda" of a CPU machine
    key = paged_module.table_key(128, 4, 8, 4096, torch.bfloat16)
    assert key == "d128_g4_b8_ctx4096_dtypebfloat16"
    tuned_table({"paged_attention": {key: dict(block_n=128, num_warps=8, num_stages=2, num_splits=4, us=20.0)}})
    plan = paged_module.plan_launch(7, 8, 4, 1, 3000, 128, torch.bfloat16, "cuda")  # batch 7 -> bucket 8
    assert plan == PagedConfig(16, 128, 8, 2, num_splits=4)
    chunk = paged_module.plan_launch(7, 8, 4, 9, 3000, 128, torch.bfloat16, "cuda")  # prefill rows: heuristics
    assert (chunk.block_n, chunk.num_warps) == (64, 8)
    forced = PagedConfig(16, 32, 4, 2, num_splits=2)
    assert paged_module.plan_launch(7, 8, 4, 1, 3000, 128, torch.bfloat16, "cuda", forced) == forced


def _packed(q_lens, heads_q, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    return torch.randn(sum(q_lens), heads_q, head_dim, generator=gen).to(dtype), cu


OPTIONS = [
    dict(),
    dict(sliding_window=37),
    dict(softcap=15.0),
    dict(sliding_window=5, softcap=2.0, scale=0.3),
    dict(sinks=True),
    dict(sinks=True, sliding_window=5),
    dict(chunk_size=13),
    dict(chunk_size=6, softcap=2.0),
]


def _sinks(heads: int, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    """One sink logit per query head, some above the scores' range (they then take most of the weight)."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_match_reference(dtype, splits):
    """Attention sinks in the single-pass kernel and in the combine of a split launch, packed decode tokens beside
    prefill chunks, and the padding rows of a static step left at zeros."""
    k_pool, v_pool = _pool(64, 2, 64, dtype)
    q_lens = [1, 7, 1, 17, 1]
    tables, lens = _tables([1, 40, 300, 17, 0], 64)
    q, cu = _packed(q_lens, 8, 64, dtype)
    sinks = _sinks(8, dtype)
    out = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=17,
        max_seqlen_k=300,
        backend="triton",
        num_splits=splits,
        sinks=sinks,
    )
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # a padding row (length 0)
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, sinks=sinks))


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, head_dim", [((4, 4), 64), ((6, 2), 24), ((8, 1), 80), ((3, 3), 256)], ids=lambda v: str(v)
)
def test_torch_backend_matches_reference(heads, head_dim, dtype, options):
    """The batched torch backend on odd sizes: dense queries longer than some sequences (their first rows see
    nothing), packed decode tokens beside prefill chunks, GQA, window, softcap."""
    k_pool, v_pool = _pool(41, heads[1], head_dim, dtype)
    tables, lens = _tables(LENGTHS, 41)
    if "sinks" in options:
        options = {**options, "sinks": _sinks(heads[0], dtype)}
    dense_q = torch.randn(len(LENGTHS), heads[0], 3, head_dim).to(dtype)
    out = on_device(paged_attention, dense_q, k_pool, v_pool, tables, lens, backend="torch", **options)
    assert out.shape == (len(LENGTHS), 3, heads[0], head_dim)
    assert_close(out, paged_attention_reference(dense_q, k_pool, v_pool, tables, lens, **options))
    q_lens = [1, 7, 1, 17, 1]
    q, cu = _packed(q_lens, heads[0], head_dim, dtype)
    tables, lens = _tables([1, 40, 300, 17, 33], 41)
    out = on_device(
        paged_attention, q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, max_seqlen_q=17, backend="torch", **options
    )
    assert out.shape == q.shape
    assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, **options))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_decode_batch_with_padding_rows(dtype):
    """An engine decode step (one query per sequence, the layout needs no scatter) with padding rows of length 0
    (zeros), a key mask narrower than the tables, and ``max_seqlen_k`` bounding the keys read; also the same
    sequences through the scatter of the general packed path (``max_seqlen_q`` not given)."""
    k_pool, v_pool = _pool(64, 2, 48, dtype)
    tables, lens = _tables([40, 17, 1, 163, 1, 1], 64)
    lens[4:] = 0
    key_mask = torch.rand(6, 170, generator=torch.Generator().manual_seed(1)) > 0.3
    q, cu = _packed([1] * 6, 6, 48, dtype)
    expected = paged_attention_reference(q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu)
    decode = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=1,
        max_seqlen_k=163,
        backend="torch",
    )
    assert torch.equal(decode[4:], torch.zeros_like(decode[4:]))
    assert_close(decode, expected)
    assert_close(
        on_device(paged_attention, q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, backend="torch"), expected
    )
    dense_q = q[:, :, None]  # [S, Hq, 1, D]
    out = on_device(
        paged_attention, dense_q, k_pool, v_pool, tables, lens, key_mask=key_mask, max_seqlen_k=163, backend="torch"
    )
    assert_close(out, paged_attention_reference(dense_q, k_pool, v_pool, tables, lens, key_mask=key_mask))


def test_torch_backend_empty_batches():
    k_pool, v_pool = _pool(4, 2, 32, torch.float32)
    tables, lens = torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    dense = on_device(paged_attention, torch.randn(0, 4, 1, 32), k_pool, v_pool, tables, lens, backend="torch")
    assert dense.shape == (0, 1, 4, 32)
    packed = on_device(
        paged_attention,
        torch.randn(0, 4, 32),
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        backend="torch",
    )
    assert packed.shape == (0, 4, 32)
    tables, lens = _tables([5, 9], 4)  # sequences in the call, no query among them
    none = on_device(
        paged_attention,
        torch.randn(0, 4, 32),
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=torch.zeros(3, dtype=torch.int32),
        max_seqlen_q=0,
        backend="torch",
    )
    assert none.shape == (0, 4, 32)


def test_torch_backend_serves_without_the_per_sequence_reference(monkeypatch):
    """The torch backend is batched: the per-sequence reference is for checking only."""

    def per_sequence(*args, **kwargs):
        raise AssertionError("the torch backend looped over sequences")

    k_pool, v_pool = _pool(16, 2, 32, torch.float32)
    tables, lens = _tables([20, 3], 16)
    q = torch.randn(2, 4, 1, 32)
    expected = paged_attention_reference(q, k_pool, v_pool, tables, lens)
    monkeypatch.setattr(paged_module, "paged_attention_reference", per_sequence)
    monkeypatch.setattr(paged_module, "flash_attention_reference", per_sequence)
    assert_close(paged_attention(q, k_pool, v_pool, tables, lens, backend="torch"), expected)


def test_bad_inputs_raise():
    k_pool, v_pool = _pool(8, 2, 64, torch.float32)
    tables, lens = _tables([20], 8)
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(q, k_pool, v_pool, tables.long(), lens)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention(q, k_pool, v_pool, tables, lens.long())
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(torch.randn(1, 3, 1, 64), k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="packed"):
        paged_attention(q, k_pool, v_pool, tables, lens, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))


def _fp8_pool(num_blocks: int, heads_kv: int, head_dim: int, seed: int = 0):
    """An fp8 pool (keys and values as write_kv stores them) and its per-head scales, values up to ~8x each scale."""
    gen = torch.Generator().manual_seed(seed)
    scales = [(torch.rand(heads_kv, generator=gen) + 0.25) for _ in range(2)]
    shape = (num_blocks, BLOCK_SIZE, heads_kv, head_dim)
    pools = [
        quantize_kv(torch.randn(shape, generator=gen) * 8 * scale[:, None], scale, torch.float8_e4m3fn)
        for scale in scales
    ]
    return (*pools, *scales)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_pool_matches_reference_on_dequantized_kv(dtype, splits, backend):
    """Packed decode tokens beside prefill chunks over an fp8 pool with per-head scales (odd head dim, GQA, a
    window and softcap): the paged kernel and the torch backend equal attention over the dequantized K/V (in fp32:
    the kernel applies the scales in fp32, a 16-bit dequantized copy would round them)."""
    k_pool, v_pool, k_scale, v_scale = _fp8_pool(64, 3, 40)
    tables, lens = _tables([1, 40, 300, 17, 0], 64)
    q, cu = _packed([1, 7, 1, 17, 1], 6, 40, dtype)
    options = dict(sliding_window=29, softcap=9.0, scale=0.21)
    out = on_device(
        paged_attention,
        q,
        k_pool,
        v_pool,
        tables,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=17,
        max_seqlen_k=300,
        backend=backend,
        num_splits=splits if backend == "triton" else None,
        k_scale=k_scale,
        v_scale=v_scale,
        **options,
    )
    dequantized = [dequantize_kv(pool, scale, torch.float32) for pool, scale in ((k_pool, k_scale), (v_pool, v_scale))]
    expected = paged_attention_reference(q.float(), *dequantized, tables, lens, cu_seqlens_q=cu, **options)
    assert_close(out, expected.to(dtype))
    assert_close(
        paged_attention_reference(
            q.float(), k_pool, v_pool, tables, lens, cu_seqlens_q=cu, k_scale=k_scale, v_scale=v_scale, **options
        ),
        expected,
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_into_an_fp8_pool_quantizes_per_head(dtype, backend):
    """write_kv into an fp8 pool stores each value over its head's scale, saturated at e4m3's 448 (values far past
    it included), exactly as quantize_kv does; slot -1 skips its token. The values are e4m3 ones times their head's
    scale: the rounding is the conversion's own (the Triton interpreter's, triton 3.9, drops the carry of a mantissa
    that rounds up to the next power of two: 127.9 -> 64), what is tested is the scaling, saturation and slots."""
    pools = [torch.zeros(8, BLOCK_SIZE, 3, 40, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    k_scale, v_scale = torch.tensor([0.5, 1.0, 3.0]), torch.tensor([2.0, 0.25, 1.0])
    gen = torch.Generator().manual_seed(0)
    e4m3 = [(torch.randn(2, 5, 3, 40, generator=gen) * 100).to(torch.float8_e4m3fn).float() for _ in range(2)]
    k = (e4m3[0] * k_scale[:, None]).to(dtype)
    k[0, 0, 2, :4] = torch.tensor([5000.0, -5000.0, 1e6, -1e6])  # past 448 * 3.0: saturated
    v = (e4m3[1] * v_scale[:, None]).to(dtype)
    slots = torch.tensor([[0, 17, -1, 40, 127], [3, 4, 5, -1, 60]])
    on_device(write_kv, k, v, *pools, slots, backend=backend, k_scale=k_scale, v_scale=v_scale)
    k_pool, v_pool = (pool.cpu() for pool in pools)
    kept = slots.flatten() >= 0
    for pool, new, scale in ((k_pool, k, k_scale), (v_pool, v, v_scale)):
        stored = pool.view(-1, 3, 40)[slots.flatten()[kept]]
        expected = quantize_kv(new.reshape(-1, 3, 40)[kept], scale, torch.float8_e4m3fn)
        assert torch.equal(stored.float(), expected.float())
        assert stored.float().abs().max() <= 448
    with pytest.raises(ValueError, match="needs k_scale"):
        write_kv(k, v, k_pool, v_pool, slots, k_scale=None, v_scale=v_scale)
    with pytest.raises(ValueError, match="without scales"):
        write_kv(k, v, *_pool(8, 3, 40, dtype), slots, k_scale=k_scale, v_scale=v_scale)


def test_custom_op_takes_the_models_query_layout():
    """torch.ops.hfaccel.paged_attention: schema and fake agree (opcheck) in both forms, the packed query as the
    model hands it over (``[1, Hq, T, D]``, a transposed view of its projection) -> ``[1, T, Hq, D]``; and a
    dynamic fullgraph trace at T = 3 serves T = 1 without a second graph."""
    from torch._dynamo.utils import counters

    from hfaccel.compat import marked_sizes_only
    from hfaccel.kernels.ops import paged_attention_op

    k_pool, v_pool = _pool(16, 2, 24, torch.float32)
    kv_cache = torch.stack([k_pool, v_pool])[None]  # [L=1, 2, blocks, block_size, Hkv, D]
    tables, lens = _tables([5, 40, 17], 16)
    packed, cu = _packed([1, 2, 1], 6, 24, torch.float32)
    query = packed[None].transpose(1, 2)  # [1, Hq, T, D]
    args = (query, kv_cache, 0, tables, lens, cu, 2, 40, 0.3, None, None, None, None, None, "torch")
    torch.library.opcheck(paged_attention_op, args)
    out = paged_attention_op(*args)
    assert out.shape == (1, 4, 6, 24)
    assert_close(out[0], paged_attention_reference(packed, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, scale=0.3))
    dense = torch.randn(3, 6, 2, 24)
    torch.library.opcheck(paged_attention_op, (dense, *args[1:5], None, 2, 40, 0.3, *args[9:]))

    def step(projected: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        query = projected.view(1, -1, 6, 24).transpose(1, 2)  # no RoPE: the projection's layout
        return (
            paged_attention_op(query, kv_cache, 0, tables, lens, cu, 2, 40, 0.3, None, None, None, None, None, "torch")
            * 2
        )

    compiled = torch.compile(step, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for q_lens in ([1, 1, 1], [1]):
        rows = len(q_lens)
        packed, cu = _packed(q_lens, 6, 24, torch.float32)
        inputs = (packed.reshape(1, rows, -1), tables[:rows], lens[:rows], cu)
        for tensor, dim in zip(inputs, (1, 0, 0, 0)):  # as the runner marks a decode step's inputs
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        with marked_sizes_only():
            got = compiled(*inputs)
        want = (
            paged_attention_reference(packed, k_pool, v_pool, tables[:rows], lens[:rows], cu_seqlens_q=cu, scale=0.3)
            * 2
        )
        assert_close(got[0], want)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("fp8", [False, True], ids=["float-pool", "fp8-pool"])
def test_write_kv_custom_op_declares_its_write_into_the_pool(fp8):
    """torch.ops.hfaccel.write_kv: schema (the pool is mutated in place, nothing returned), fake implementation and
    autograd registration agree (opcheck) on odd sizes (Hkv 3, D 40, skipped slots), for a float pool and an fp8 one
    with per-head scales; the op writes what the launcher writes, into the layer it names."""
    from hfaccel.kernels.ops import write_kv_op

    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k_pool, v_pool = (pool.to(dtype) for pool in _pool(3, 3, 40, torch.float32))
    kv_cache = torch.stack([torch.stack([k_pool, v_pool])] * 2).to(DEVICE)  # [L=2, 2, blocks, block_size, Hkv, D]
    scales = torch.tensor([[0.5, 1.0, 3.0], [2.0, 0.25, 1.0]], device=DEVICE)
    kv_scales = scales.expand(2, 2, 3).contiguous() if fp8 else None  # [L, 2, Hkv]
    new_k, new_v = torch.randn(2, 3, 3, 40, device=DEVICE), torch.randn(2, 3, 3, 40, device=DEVICE)
    slots = torch.tensor([[0, 17, -1], [46, -1, 5]], device=DEVICE)
    expected = kv_cache.clone()
    layer_scales = {"k_scale": scales[0], "v_scale": scales[1]} if fp8 else {}
    write_kv(new_k, new_v, expected[1, 0], expected[1, 1], slots, backend="auto", **layer_scales)
    # opcheck's schema test (which catches an undeclared write: the pool it gets is unwritten) compares the inputs
    # before and after with arithmetic torch has no fp8 CPU kernel for: the float pool runs it
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    args = (new_k, new_v, kv_cache.clone(), 1, slots, "auto", kv_scales)
    torch.library.opcheck(write_kv_op, args, test_utils=utils if fp8 else ("test_schema", *utils))
    assert write_kv_op(new_k, new_v, kv_cache, *args[3:]) is None
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_reference(dtype):
    k_pool, v_pool = _pool(8, 3, 80, dtype)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    new_k = torch.randn(2, 3, 5, 80).to(dtype).transpose(1, 2)  # [B, S, Hkv, D] view of [B, Hkv, S, D]
    new_v = torch.randn(2, 3, 5, 80).to(dtype).transpose(1, 2)
    slots = torch.tensor([[3, 17, 18, 19, -1], [100, 101, 5, 6, 127]])
    pools = k_pool.to(DEVICE), v_pool.to(DEVICE)
    on_device(write_kv, new_k, new_v, *pools, slots, backend="triton")
    k_pool, v_pool = pools[0].cpu(), pools[1].cpu()
    write_kv_reference(new_k, new_v, expected_k, expected_v, slots)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    assert torch.equal(k_pool.view(-1, 3, 80)[17], new_k[0, 1])


@pytest.mark.parametrize(
    "slots",
    [[[4, -1, 9], [-1, 0, 11]], [[-1, -1, -1], [-1, -1, -1]], [[-1, 15, 2], [3, 1, -1]]],
    ids=["some-skipped", "all-skipped", "first-skipped"],
)
def test_write_kv_on_a_device_skips_slot_minus_one_without_reading_on_the_host(slots):
    """The torch backend on a GPU (attention="torch", inside captured decode steps) writes the kept rows, leaves
    every other slot alone (the pool's last slot included where no row is kept), and never makes the host wait for
    the device (the CPU's boolean-mask selection would: a CUDA graph capture of the step failed); the CPU's path
    writes the same."""
    from hfaccel.kernels.write_kv import write_kv_on_device
    from tests.speculative.host_reads import HostReads

    k_pool, v_pool = _pool(4, 3, 16, torch.float32)  # 16 slots
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    new_k, new_v = torch.randn(2, 3, 3, 16), torch.randn(2, 3, 3, 16)
    slot_mapping = torch.tensor(slots)
    for (b, s), slot in zip([(b, s) for b in range(2) for s in range(3)], slot_mapping.flatten().tolist()):
        if slot >= 0:
            expected_k.view(-1, 3, 16)[slot] = new_k[b, s]
            expected_v.view(-1, 3, 16)[slot] = new_v[b, s]
    on_cpu = k_pool.clone(), v_pool.clone()
    write_kv(new_k, new_v, *on_cpu, slot_mapping, backend="torch")
    with HostReads() as waits:
        write_kv_on_device(new_k, new_v, k_pool, v_pool, slot_mapping)
    assert not waits.reads and not waits.uploads, (waits.reads, waits.uploads)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    assert torch.equal(on_cpu[0], expected_k) and torch.equal(on_cpu[1], expected_v)
    write_kv_on_device(new_k[:, :0], new_v[:, :0], k_pool, v_pool, slot_mapping[:, :0])  # no rows: nothing written
    assert torch.equal(k_pool, expected_k)


def test_write_kv_bad_inputs():
    k_pool, v_pool = _pool(4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv(torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), k_pool, v_pool, torch.zeros(1, 3).long())
    with pytest.raises(ValueError, match="pool holds"):
        write_kv(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), k_pool, v_pool, torch.zeros(1, 2).long())


# sm_90: every (dtype, head dim, tile height) default_paged_config can return and every decode tile a tuned table
# can hold, each flag combination that changes the code path (split or not, varlen or dense), plus the split
# combine (2 to MAX_SPLITS splits) and the write kernel; an fp8 pool under 16-bit queries, decode and prefill tiles.
SM90_CASES = [
    (dtype, head_dim, default_paged_config(head_dim, dtype, rows), split, varlen)
    for dtype in DTYPES
    for head_dim in (64, 80, 96, 128, 256, 512)
    for rows in (1, 24, 48, 4096)
    for split, varlen in ((False, False), (True, True))
]
SM90_CASES += [
    (torch.float16, head_dim, cfg, True, True)
    for head_dim in (64, 128, 256, 512)
    for cfg in candidate_paged_configs(head_dim, torch.float16, 4)
]
# a latent layer read absorbed: DeepSeek's 512 + 64 latents as one head, 16 (V2-Lite) or 128 (V3) query heads
SM90_CASES += [
    (dtype, 576, cfg, split, True)
    for dtype in (torch.float16, torch.bfloat16)
    for rows in (16, 128)
    for cfg in {default_paged_config(576, dtype, rows), *candidate_paged_configs(576, dtype, rows)}
    for split in (False, True)
]
SM90_CASES += [
    (dtype, head_dim, default_paged_config(head_dim, dtype, rows), split, True, torch.float8_e4m3fn)
    for dtype in (torch.float16, torch.bfloat16)
    for head_dim in (64, 128, 256)
    for rows in (4, 4096)
    for split in (False, True)
]
UNIT_STRIDES = ("stride_qd", "stride_od", "stride_kd", "stride_vd", "stride_bt_col", "stride_mask_col")


def _attention_job(dtype, head_dim, cfg, split, varlen, pool_dtype=None):
    ptr = "*" + TRITON_TYPES[dtype]
    pool = "*" + TRITON_TYPES[pool_dtype or dtype]
    kernel = paged_module._paged_attention_kernel
    signature = {name: "i32" for name in kernel.arg_names if name.startswith("stride_")}
    signature.update(
        {name: "i32" for name in ("num_kv_heads", "head_dim", "block_size", "uniform_q_len", "window", "chunk")}
    )
    signature.update(
        Q=ptr,
        K_POOL=pool,
        V_POOL=pool,
        O=ptr,
        BLOCK_TABLES="*i32",
        SEQ_LENS="*i32",
        CU_SEQLENS_Q="*i32",
        KEY_MASK="*i1",
        SINKS="*fp32",
        PART_O="*fp32",
        PART_LSE="*fp32",
        K_SCALE="*fp32",
        V_SCALE="*fp32",
        score_scale="fp32",
        softcap_log2="fp32",
    )
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    constexprs = dict(
        GROUP=4,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        VARLEN=varlen,
        HAS_WINDOW=True,
        HAS_CHUNK=True,
        HAS_SOFTCAP=True,
        HAS_KEY_MASK=True,
        HAS_SINKS=True,
        SPLIT=split,
        UPCAST=False,
        IEEE_FP32=dtype == torch.float32,
        FP8_KV=pool_dtype is not None,
    )
    return dict(
        module="hfaccel.kernels.paged_attention",
        kernel="_paged_attention_kernel",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_like(kernel, signature, constexprs, UNIT_STRIDES),
    )


def _side_jobs():
    combine = paged_module._combine_splits_kernel
    write_module = importlib.import_module("hfaccel.kernels.write_kv")
    jobs = []
    for dtype in DTYPES:
        for head_dim in (64, 256, 512, 1024):
            signature = {
                name: "i32" for name in combine.arg_names if name not in ("BLOCK_S", "BLOCK_D", "VARLEN", "HAS_SINKS")
            }
            signature.update(
                O="*" + TRITON_TYPES[dtype], PART_O="*fp32", PART_LSE="*fp32", CU_SEQLENS_Q="*i32", SINKS="*fp32"
            )
            for splits in (2, paged_module.MAX_SPLITS):
                constexprs = dict(BLOCK_S=splits, BLOCK_D=head_dim, VARLEN=True, HAS_SINKS=True)
                jobs.append(
                    dict(
                        module="hfaccel.kernels.paged_attention",
                        kernel="_combine_splits_kernel",
                        num_warps=combine_warps(splits, head_dim),
                        num_stages=1,
                        **launch_like(combine, signature, constexprs, ("stride_od",)),
                    )
                )
            ptr = "*" + TRITON_TYPES[dtype]
            for pool in (ptr, "*fp8e4nv") if dtype != torch.float32 else (ptr,):
                signature = {
                    name: "i32"
                    for name in write_module._write_kv_kernel.arg_names
                    if name not in ("BLOCK_H", "BLOCK_D", "QUANTIZE", "QMAX")
                }
                signature.update(K=ptr, V=ptr, K_POOL=pool, V_POOL=pool, SLOTS="*i64", K_SCALE="*fp32", V_SCALE="*fp32")
                for block_h in (1, 8):  # one KV head (MQA) to Llama-3's eight
                    constexprs = dict(
                        BLOCK_H=block_h, BLOCK_D=head_dim, QUANTIZE=pool != ptr, QMAX=write_module.FP8_MAX
                    )
                    jobs.append(
                        dict(
                            module="hfaccel.kernels.write_kv",
                            kernel="_write_kv_kernel",
                            signature=signature,
                            constexprs=constexprs,
                            num_warps=write_module.write_kv_warps(block_h * head_dim),
                            num_stages=1,
                        )
                    )
    return jobs


SIDE_JOBS = _side_jobs()


def test_compiles_for_sm90():
    def check(case, result):
        assert result["shared"] <= 227 * 1024, f"{result['shared']} bytes of shared memory"

    cases = SM90_CASES + [job["kernel"] for job in SIDE_JOBS]
    assert_each_compiles_for_sm90(cases, [_attention_job(*case) for case in SM90_CASES] + SIDE_JOBS, check)
