"""paged_attention / write_kv (Triton, interpreted) vs their references; split-K; sm_90 compilation."""

import importlib

import pytest
import torch

from hfaccel.kernels.paged_attention import (
    choose_num_splits, paged_attention, paged_attention_reference, pick_paged_config,
)
from hfaccel.kernels.write_kv import write_kv, write_kv_reference
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, assert_close, compile_sm90

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
        tables[row, :count] = perm[used:used + count].to(torch.int32)
        used += count
    return tables, torch.tensor(lengths, dtype=torch.int32)


LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [((4, 4), 64), ((8, 2), 80), ((6, 2), 128), ((8, 1), 256)],
                         ids=lambda v: str(v))
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
    out = on_device(paged_attention, q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                          backend="triton", num_splits=1)
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
    out = on_device(paged_attention, q, k_pool, v_pool, tables, lens, cu_seqlens_q=cu, max_seqlen_q=1,
                    max_seqlen_k=256, backend="triton", num_splits=splits)
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
        out = on_device(paged_attention, q, k_pool, v_pool, tables, lens, backend="triton", num_splits=splits,
                        **kwargs)
        assert torch.isfinite(out).all()
        assert_close(out, expected)


def test_split_heuristic():
    assert choose_num_splits(num_programs=8, max_seqlen_k=8192) == 32
    assert choose_num_splits(num_programs=64, max_seqlen_k=4096) == 4
    assert choose_num_splits(num_programs=512, max_seqlen_k=32768) == 1
    assert choose_num_splits(num_programs=8, max_seqlen_k=300) == 1


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


def test_write_kv_bad_inputs():
    k_pool, v_pool = _pool(4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv(torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), k_pool, v_pool, torch.zeros(1, 3).long())
    with pytest.raises(ValueError, match="pool holds"):
        write_kv(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), k_pool, v_pool, torch.zeros(1, 2).long())


# sm_90: every (dtype, head dim, tile height) pick_paged_config can return, each flag combination that
# changes the code path (split or not, varlen or dense), plus the split combine and the write kernel.
SM90_CASES = [(dtype, head_dim, rows, split, varlen) for dtype in DTYPES for head_dim in (64, 80, 96, 128, 256)
              for rows in (1, 24, 48, 4096) for split, varlen in ((False, False), (True, True))]


def _attention_job(dtype, head_dim, rows, split, varlen):
    block_m, block_n, num_warps, num_stages = pick_paged_config(head_dim, dtype, rows)
    ptr = "*" + TRITON_TYPES[dtype]
    kernel = paged_module._paged_attention_kernel
    signature = {name: "i32" for name in kernel.arg_names if name.startswith("stride_")}
    signature.update({name: "i32" for name in ("num_kv_heads", "head_dim", "block_size", "uniform_q_len",
                                               "window", "keys_per_split")})
    signature.update(Q=ptr, K_POOL=ptr, V_POOL=ptr, O=ptr, BLOCK_TABLES="*i32", SEQ_LENS="*i32",
                     CU_SEQLENS_Q="*i32", KEY_MASK="*i1", PART_O="*fp32", PART_LSE="*fp32",
                     score_scale="fp32", softcap_log2="fp32")
    constexprs = dict(GROUP=4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
                      VARLEN=varlen, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_KEY_MASK=True, SPLIT=split,
                      UPCAST=False, IEEE_FP32=dtype == torch.float32)
    return dict(module="hfaccel.kernels.paged_attention", kernel="_paged_attention_kernel", signature=signature,
                constexprs=constexprs, num_warps=num_warps, num_stages=num_stages)


def _side_jobs():
    combine = paged_module._combine_splits_kernel
    jobs = []
    for dtype in DTYPES:
        for head_dim in (64, 256):
            signature = {name: "i32" for name in combine.arg_names if name not in ("BLOCK_D", "VARLEN")}
            signature.update(O="*" + TRITON_TYPES[dtype], PART_O="*fp32", PART_LSE="*fp32", CU_SEQLENS_Q="*i32")
            jobs.append(dict(module="hfaccel.kernels.paged_attention", kernel="_combine_splits_kernel",
                             signature=signature, constexprs=dict(BLOCK_D=head_dim, VARLEN=True),
                             num_warps=1 if head_dim <= 128 else 2, num_stages=1))
            write_module = importlib.import_module("hfaccel.kernels.write_kv")
            signature = {name: "i32" for name in write_module._write_kv_kernel.arg_names
                         if name not in ("BLOCK_H", "BLOCK_D")}
            ptr = "*" + TRITON_TYPES[dtype]
            signature.update(K=ptr, V=ptr, K_POOL=ptr, V_POOL=ptr, SLOTS="*i64")
            for block_h in (1, 8):  # one KV head (MQA) to Llama-3's eight
                jobs.append(dict(module="hfaccel.kernels.write_kv", kernel="_write_kv_kernel", signature=signature,
                                 constexprs=dict(BLOCK_H=block_h, BLOCK_D=head_dim),
                                 num_warps=write_module.write_kv_warps(block_h * head_dim), num_stages=1))
    return jobs


@pytest.fixture(scope="module")
def sm90_results():
    return compile_sm90([_attention_job(*case) for case in SM90_CASES] + _side_jobs())


@pytest.mark.parametrize("index", range(len(SM90_CASES) + 18))
def test_compiles_for_sm90(index, sm90_results):
    result = sm90_results[index]
    assert result["ok"], f"job {index}: {result.get('error')}"
    assert result["shared"] <= 227 * 1024, f"job {index}: {result['shared']} bytes of shared memory"
