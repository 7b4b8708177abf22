"""AWQ / GPTQ layouts: round trips, and hand-built checkpoints written straight from the format description."""

import pytest
import torch

from hfaccel.quant import formats

K, N, G = 256, 48, 64


def _random_q(rows, cols, seed=0):
    return torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def _pack_words_by_hand(values, order):
    """One int32 word from 8 nibbles: nibble j (bits 4j..4j+3) holds values[order[j]] — spelled out bit by bit."""
    word = 0
    for j in range(8):
        word |= int(values[order[j]]) << (4 * j)
    return word - (1 << 32) if word >= 1 << 31 else word


def test_row_and_column_packing_round_trip():
    q = _random_q(K, N)
    assert torch.equal(formats.unpack_along_rows(formats.pack_along_rows(q)), q)
    assert torch.equal(formats.unpack_along_cols(formats.pack_along_cols(q)), q)
    awq = formats.pack_along_cols(q, formats.AWQ_ORDER)
    assert torch.equal(formats.unpack_along_cols(awq, formats.AWQ_ORDER), q)
    assert not torch.equal(awq, formats.pack_along_cols(q))  # the orders really differ


def test_hand_built_awq_checkpoint_dequantizes_to_the_formula():
    q, z = _random_q(K, N, 1), _random_q(K // G, N, 2)
    scales = torch.rand(K // G, N, generator=torch.Generator().manual_seed(3)).half() + 0.01
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of word c holds column 8c + order[j]
    qweight = torch.tensor([[_pack_words_by_hand(q[r, 8 * c:8 * c + 8], order) for c in range(N // 8)]
                            for r in range(K)], dtype=torch.int32)
    qzeros = torch.tensor([[_pack_words_by_hand(z[r, 8 * c:8 * c + 8], order) for c in range(N // 8)]
                           for r in range(K // G)], dtype=torch.int32)
    weight = formats.from_awq(qweight, qzeros, scales, G)
    expected = torch.empty(N, K)
    for o in range(N):
        for i in range(K):
            expected[o, i] = (q[i, o] - z[i // G, o]) * scales[i // G, o].float()
    assert torch.equal(weight.dequantize(), expected)
    back = formats.to_awq(weight)
    assert torch.equal(back["qweight"], qweight) and torch.equal(back["qzeros"], qzeros)


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
@pytest.mark.parametrize("act_order", [False, True], ids=["no-act-order", "act-order"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_hand_built_gptq_checkpoint_dequantizes_to_the_formula(v1, act_order, sym):
    gen = torch.Generator().manual_seed(4)
    q = _random_q(K, N, 5)
    z = torch.full((K // G, N), 8, dtype=torch.int32) if sym else _random_q(K // G, N, 6)
    scales = torch.rand(K // G, N, generator=gen).half() + 0.01
    g_idx = torch.arange(K, dtype=torch.int32) // G
    if act_order:  # columns quantized in a permuted order: group of column i = position of i in that order // G
        order = torch.randperm(K, generator=gen)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // G).to(torch.int32)
    stored_z = (z - 1) & 0xF if v1 else z
    qweight = torch.tensor([[_pack_words_by_hand(q[8 * r:8 * r + 8, o], range(8)) for o in range(N)]
                            for r in range(K // 8)], dtype=torch.int32)
    qzeros = torch.tensor([[_pack_words_by_hand(stored_z[r, 8 * c:8 * c + 8], range(8)) for c in range(N // 8)]
                           for r in range(K // G)], dtype=torch.int32)
    weight = formats.from_gptq(qweight, qzeros, scales, g_idx, G, v1=v1)
    expected = torch.empty(N, K)
    for o in range(N):
        for i in range(K):
            expected[o, i] = scales[g_idx[i], o].float() * (q[i, o] - z[g_idx[i], o])
    assert torch.equal(weight.dequantize(), expected)
    assert (weight.perm is not None) == act_order
    back = formats.to_gptq(weight, v1=v1)
    assert torch.equal(back["qweight"], qweight) and torch.equal(back["qzeros"], qzeros)
    assert torch.equal(back["g_idx"], g_idx)


def test_gptq_g_idx_with_uneven_groups_is_rejected():
    q = formats.pack_along_rows(_random_q(K, N))
    zeros = formats.pack_along_cols(_random_q(K // G, N))
    g_idx = torch.zeros(K, dtype=torch.int32)
    g_idx[-1] = 1
    with pytest.raises(ValueError, match="exactly group_size"):
        formats.from_gptq(q, zeros, torch.ones(K // G, N).half(), g_idx, G, v1=False)


def test_awq_refuses_act_order_weights():
    weight = formats.Int4Weight(formats.pack_along_rows(_random_q(K, N)), torch.ones(K // G, N),
                                torch.zeros(K // G, N), G, perm=torch.randperm(K), g_idx=torch.zeros(K))
    with pytest.raises(ValueError, match="save as gptq"):
        formats.to_awq(weight)
