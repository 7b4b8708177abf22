"""Sparse attention (DeepSeek Sparse Attention): the attention over each query's chosen keys against a dense reference
masked to them (odd sizes, grouped heads, softcap and sinks, queries with no key, chunks of queries), and the groups a
packed forward's indexers run in."""

import pytest
import torch

from hfaccel.attention import functions
from hfaccel.kv import PackedStep
from hfaccel.kv import indexer
from hfaccel.kv.indexer import index_groups
from tests.devices import DEVICE
from tests.kernels.helpers import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _reference(query, keys, values, rows, valid, scale, softcap, sinks):
    """Each query ``[Hq, D]`` over all ``keys [R, Hkv, D]`` masked to its valid ``rows``, in fp32: ``[T, Hq, Dv]``."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(heads // kv_heads, 1)  # [R, Hq, D]
    v = values.float().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,rhd->thr", query.float(), k) * scale  # [T, Hq, R]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keep = torch.zeros(query.shape[0], keys.shape[0] + 1, dtype=torch.bool, device=query.device)
    keep = keep.scatter_(1, torch.where(valid, rows, keys.shape[0]), True)[:, :-1]  # [T, R]
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[None, :, None].expand(*scores.shape[:2], 1)], -1)
    probs = scores.softmax(-1)[..., : keys.shape[0]].nan_to_num(0.0)
    return torch.einsum("thr,rhd->thd", probs, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extras", ["plain", "softcap", "sinks"])
def test_gathered_attention_equals_the_masked_reference(dtype, extras, monkeypatch):
    """13 queries, 6 heads over 2 KV heads 40 wide (values 24), each choosing 5 of 37 rows, some not valid, one query
    with none (zeros); the queries in chunks of 4 (a small gather budget) as at once."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(13, 6, 40, generator=gen).to(dtype).to(DEVICE)
    keys = torch.randn(37, 2, 40, generator=gen).to(dtype).to(DEVICE)
    values = torch.randn(37, 2, 24, generator=gen).to(dtype).to(DEVICE)
    rows = torch.stack([torch.randperm(37, generator=gen)[:5] for _ in range(13)]).to(DEVICE)  # as topk: distinct
    rows[1, 1] = rows[1, 0]  # a row chosen twice, once valid (where a query has fewer keys: -1 read as 0)
    valid = torch.rand(13, 5, generator=gen).to(DEVICE) > 0.3
    valid[4] = False  # a padding query: sees nothing
    valid[1, :2] = torch.tensor([True, False])
    softcap = 3.0 if extras == "softcap" else None
    sinks = torch.randn(6, generator=gen).to(DEVICE) if extras == "sinks" else None
    scale = 40**-0.5
    expected = _reference(query, keys, values, rows, valid, scale, softcap, sinks)
    whole = functions.gathered_attention(query, keys, values, rows, valid, scale, softcap, sinks)
    monkeypatch.setattr(functions, "GATHER_BYTES", 4 * 5 * (2 * 64 + 12) * 4)  # 4 queries per chunk
    chunked = functions.gathered_attention(query, keys, values, rows, valid, scale, softcap, sinks)
    assert whole.dtype == dtype and whole.shape == (13, 6, 24)
    assert_close(chunked, whole, dtype)
    assert torch.equal(whole[4], torch.zeros_like(whole[4]))
    assert_close(whole, expected.to(dtype), dtype)


def _step(counts, max_q_len, held=None):
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(cu[-1])
    held = counts if held is None else held
    return PackedStep(
        slot_mapping=torch.zeros(1, tokens, dtype=torch.int64),
        block_tables=torch.zeros(len(counts), 1, dtype=torch.int32),
        seq_lens=torch.tensor(held, dtype=torch.int32),
        cu_seqlens_q=cu,
        positions=torch.zeros(tokens, dtype=torch.int64),
        max_seq_len=max(held),
        max_q_len=max_q_len,
    )


def test_index_groups_gather_sequences_of_one_query_count():
    """A decode step (one token each) is one group at the step's longest; a mixed forward groups its sequences by
    their new tokens, each group's packed rows sequence by sequence, at its own longest sequence."""
    (group,) = index_groups(_step([1, 1, 1], 1, held=[5, 9, 2]))
    assert group.length == 1 and group.tokens.tolist() == [0, 1, 2] and group.sequences.tolist() == [0, 1, 2]
    assert group.held == 9
    groups = index_groups(_step([3, 1, 3, 2], 3, held=[3, 40, 7, 2]))
    assert [(g.length, g.sequences.tolist(), g.tokens.tolist(), g.held) for g in groups] == [
        (1, [1], [3], 40),
        (2, [3], [7, 8], 2),
        (3, [0, 2], [0, 1, 2, 4, 5, 6], 7),
    ]


def test_indexer_calls_stay_within_their_budget(monkeypatch):
    """An indexer runs a group in calls of at most INDEXER_BYTES: whole sequences where they fit, else runs of one
    sequence's queries in order — every query once."""
    (group,) = index_groups(_step([3, 3, 3], 3, held=[10, 10, 10]))
    monkeypatch.setattr(indexer, "INDEXER_BYTES", 6 * 100)  # two sequences of 3 queries at 100 bytes a query
    together = list(indexer.calls(group, 100))
    assert [(c.sequences.tolist(), c.tokens.tolist()) for c in together] == [([0, 1], list(range(6))), ([2], [6, 7, 8])]
    monkeypatch.setattr(indexer, "INDEXER_BYTES", 2 * 100)  # two queries of one sequence
    runs = list(indexer.calls(group, 100))
    assert [(c.sequences.tolist(), c.tokens.tolist(), c.length) for c in runs] == [
        ([0], [0, 1], 2),
        ([0], [2], 1),
        ([1], [3, 4], 2),
        ([1], [5], 1),
        ([2], [6, 7], 2),
        ([2], [8], 1),
    ]
