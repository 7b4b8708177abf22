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
    qweight = torch.tensor(
        [[_pack_words_by_hand(q[r, 8 * c : 8 * c + 8], order) for c in range(N // 8)] for r in range(K)],
        dtype=torch.int32,
    )
    qzeros = torch.tensor(
        [[_pack_words_by_hand(z[r, 8 * c : 8 * c + 8], order) for c in range(N // 8)] for r in range(K // G)],
        dtype=torch.int32,
    )
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
    qweight = torch.tensor(
        [[_pack_words_by_hand(q[8 * r : 8 * r + 8, o], range(8)) for o in range(N)] for r in range(K // 8)],
        dtype=torch.int32,
    )
    qzeros = torch.tensor(
        [[_pack_words_by_hand(stored_z[r, 8 * c : 8 * c + 8], range(8)) for c in range(N // 8)] for r in range(K // G)],
        dtype=torch.int32,
    )
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
    weight = formats.Int4Weight(
        formats.pack_along_rows(_random_q(K, N)),
        torch.ones(K // G, N),
        torch.zeros(K // G, N),
        G,
        perm=torch.randperm(K),
        g_idx=torch.zeros(K),
    )
    with pytest.raises(ValueError, match="save as gptq"):
        formats.to_awq(weight)


@pytest.mark.parametrize("fmt", ["awq", "gptq-v1-act-order", "gptq-v2-sym"])
def test_hand_built_checkpoint_folder_loads(tmp_path, fmt):
    """A whole checkpoint folder written by this test from the format description (not by hfaccel's writer):
    load_quantized gives Int4Linear layers whose weights are exactly the formula's."""
    import json

    import transformers
    from safetensors.torch import save_file

    import hfaccel

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    plain = transformers.LlamaForCausalLM(config)
    tensors, expected = {}, {}
    gen = torch.Generator().manual_seed(9)
    for name, module in plain.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        k, n = module.in_features, module.out_features
        q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        z = (
            torch.full((k // G, n), 8, dtype=torch.int32)
            if fmt.endswith("sym")
            else torch.randint(0, 16, (k // G, n), generator=gen, dtype=torch.int32)
        )
        s = (torch.rand(k // G, n, generator=gen) * 0.1 + 0.01).half()
        g_idx = torch.arange(k, dtype=torch.int32) // G
        if "act-order" in fmt:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        if fmt == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors[f"{name}.qweight"] = torch.tensor(
                [[_pack_words_by_hand(q[r, 8 * c : 8 * c + 8], order) for c in range(n // 8)] for r in range(k)],
                dtype=torch.int32,
            )
            tensors[f"{name}.qzeros"] = torch.tensor(
                [[_pack_words_by_hand(z[r, 8 * c : 8 * c + 8], order) for c in range(n // 8)] for r in range(k // G)],
                dtype=torch.int32,
            )
        else:
            stored = (z - 1) & 0xF if "v1" in fmt else z
            tensors[f"{name}.qweight"] = torch.tensor(
                [[_pack_words_by_hand(q[8 * r : 8 * r + 8, o], range(8)) for o in range(n)] for r in range(k // 8)],
                dtype=torch.int32,
            )
            tensors[f"{name}.qzeros"] = torch.tensor(
                [
                    [_pack_words_by_hand(stored[r, 8 * c : 8 * c + 8], range(8)) for c in range(n // 8)]
                    for r in range(k // G)
                ],
                dtype=torch.int32,
            )
            tensors[f"{name}.g_idx"] = g_idx
        tensors[f"{name}.scales"] = s
        expected[name] = ((q.float() - z.float()[g_idx.long()]) * s.float()[g_idx.long()]).t()
    for key, value in plain.state_dict().items():
        if not any(key.startswith(name + ".") for name in expected):
            tensors[key] = value.half().contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    spec = (
        {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
        if fmt == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": G,
            "desc_act": "act-order" in fmt,
            "sym": fmt.endswith("sym"),
            "checkpoint_format": "gptq" if "v1" in fmt else "gptq_v2",
        }
    )
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": spec}))
    model = hfaccel.load_quantized(tmp_path, dtype=torch.float16)
    for name, weight in expected.items():
        module = model.get_submodule(name)
        assert isinstance(module, hfaccel.Int4Linear), name
        assert torch.equal(module.int4_weight().dequantize(), weight), name


def test_rtn_round_trip_is_quantize_then_dequantize():
    """AWQ's scale search rounds without packing (``rtn_round_trip``): exactly the values of ``quantize_rtn``'s
    packed weight dequantized, odd output counts included."""
    from hfaccel.quant.rtn import quantize_rtn, rtn_round_trip

    torch.manual_seed(0)
    weight = torch.randn(37, 192) * torch.rand(192) * 3  # [N, K]: 3 groups of 64 columns
    assert torch.equal(rtn_round_trip(weight, 64), quantize_rtn(weight, 64).dequantize())
