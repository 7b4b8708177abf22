"""Attention over K/V whose values are narrower than the keys (multi-head latent attention expands its cached latents
into keys ``qk_head_dim`` wide and values ``v_head_dim`` wide): dense calls with a padding mask, and packed sequences
whose expanded K/V come one after another in one row (``SequenceKVCache._latents``), against a per-sequence reference
on both kernel backends; and the latents' round trip through the pool's rows."""

import copy

import pytest
import torch

from hfaccel.attention import functions
from hfaccel.attention.masks import PACKED_MASK, KernelMask
from hfaccel.kv import PackedStep
from hfaccel.kv.hf_cache import PACKED_STEP_KWARG
from tests.devices import DEVICE
from tests.kernels.helpers import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = {"torch": functions.torch_attention, "triton": functions.triton_attention}


def _reference(query, key, value, scale, visible):
    """``query [Hq, Q, Dk]`` over ``key [Hkv, K, Dk]``, ``value [Hkv, K, Dv]`` where ``visible [Q, K]``, in fp32:
    ``[Q, Hq, Dv]``."""
    group = query.shape[0] // key.shape[0]
    key, value = (t.float().repeat_interleave(group, 0) for t in (key, value))
    scores = (query.float() @ key.transpose(1, 2)) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ value).transpose(0, 1)


def _random(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_values_narrower_than_keys(backend, dtype):
    """A left-padded batch (transformers' layout, as its own loop passes MLA's expanded K/V): 6 query heads over 2
    KV heads, keys 40 wide, values 24."""
    batch, heads, kv_heads, seq, key_dim, value_dim = 2, 6, 2, 13, 40, 24
    query = _random(batch, heads, seq, key_dim, dtype=dtype, seed=0)
    key = _random(batch, kv_heads, seq, key_dim, dtype=dtype, seed=1)
    value = _random(batch, kv_heads, seq, value_dim, dtype=dtype, seed=2)
    padding = torch.tensor([0, 4])
    key_mask = (torch.arange(seq)[None] >= padding[:, None]).to(DEVICE)  # [B, S]
    mask = KernelMask(key_mask=key_mask, q_offset=0, kv_offset=0, causal=True, sliding_window=None)
    out, _ = BACKENDS[backend](torch.nn.Module(), query, key, value, mask, scaling=0.3)
    assert out.shape == (batch, seq, heads, value_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().to(DEVICE)
    for b in range(batch):
        real = slice(int(padding[b]), seq)  # a padding row's output is not compared: no real key precedes it
        visible = (causal & key_mask[b][None])[real]
        want = _reference(query[b][:, real], key[b], value[b], 0.3, visible)
        assert_close(out[b, real], want.to(dtype))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_sequences_read_their_own_expanded_kv(backend, dtype):
    """Three packed sequences (3, 1 and 2 new tokens of 7, 5 and 9 held), their expanded K/V in one row, 9 per
    sequence: each query sees its own sequence's keys up to its position."""
    q_lens, seq_lens, heads, kv_heads, key_dim, value_dim = [3, 1, 2], [7, 5, 9], 4, 4, 40, 24
    length, tokens = max(seq_lens), sum(q_lens)
    query = _random(1, heads, tokens, key_dim, dtype=dtype, seed=3)
    key = _random(1, kv_heads, 3 * length, key_dim, dtype=dtype, seed=4)
    value = _random(1, kv_heads, 3 * length, value_dim, dtype=dtype, seed=5)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    positions = torch.tensor([4, 5, 6, 4, 7, 8])
    step = PackedStep(
        slot_mapping=torch.full((1, tokens), -1),
        block_tables=torch.zeros(3, 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=cu,
        positions=positions,
        max_seq_len=length,
        max_q_len=max(q_lens),
    ).to(DEVICE)
    out, _ = BACKENDS[backend](torch.nn.Module(), query, key, value, None, scaling=0.25, **{PACKED_STEP_KWARG: step})
    assert out.shape == (1, tokens, heads, value_dim)
    for s in range(3):
        rows, held = slice(int(cu[s]), int(cu[s + 1])), slice(s * length, (s + 1) * length)
        visible = (torch.arange(length)[None] <= positions[rows][:, None]).to(DEVICE)
        want = _reference(query[0][:, rows], key[0][:, held], value[0][:, held], 0.25, visible)
        assert_close(out[0, rows], want.to(dtype))


@pytest.mark.parametrize("key_dim, value_dim", [(32, 8), (31, 8), (8, 31)])
def test_a_latent_layers_two_latents_round_trip_through_the_pools_rows(key_dim, value_dim):
    """The pool stores a latent layer's latents one after the other in halves of its key and value rows (odd sums
    zero-padded): what it reads back is what was written, and the rows are half the two latents' width."""
    from hfaccel.kv.layout import AttentionKV, joined_latents, split_latents

    kv = AttentionKV(1, key_dim, value_dim, expanded_dim=64)
    latent = _random(3, 1, 5, key_dim, dtype=torch.float32, seed=6)
    rope = _random(3, 1, 5, value_dim, dtype=torch.float32, seed=7)
    keys, values = split_latents(latent, rope, kv.width)
    assert keys.shape[-1] == values.shape[-1] == kv.width == -(-(key_dim + value_dim) // 2)
    back = joined_latents(keys, values, kv)
    assert torch.equal(back[0], latent) and torch.equal(back[1], rope)
    assert all(torch.equal(x, y) for x, y in zip(joined_latents(latent, rope, kv), (latent, rope)))


def _latent_module(dtype, kv_lora_rank=37, rope=9, nope=11, value=13, heads=5):
    """A DeepSeek-V3 attention module of odd widths (its ``kv_b_proj`` random), in ``dtype``."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    config = tiny_config(
        "deepseek_v3",
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=value,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    torch.manual_seed(8)
    module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    return module.to(DEVICE, dtype).eval()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_absorbed_attention_equals_attention_over_the_expanded_kv(backend, dtype):
    """A latent layer read in the latent space (``hfaccel.kv.latent``: the query times ``W_UK``, the paged kernel over
    each token's two latents as one row, the output times ``W_UV``) gives the attention the module's own expansion
    gives: three packed sequences (3, 1 and 2 new tokens of 7, 5 and 9 held), latents 37 + 9 wide, 5 heads."""
    _check_absorbed(backend, dtype, _latent_module(dtype), (5, 11, 13), [3, 1, 2], [7, 5, 9])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_absorbed_attention_at_deepseeks_widths(dtype):
    """The Triton kernel at DeepSeek-V2-Lite's widths: latents 512 + 64 read as one head 576 wide, 16 query heads
    (keys 128 + 64, values 128); two decoding sequences of 21 and 6 held tokens."""
    module = _latent_module(dtype, kv_lora_rank=512, rope=64, nope=128, value=128, heads=16)
    _check_absorbed("triton", dtype, module, (16, 128, 128), [1, 1], [21, 6])


def _check_absorbed(backend, dtype, module, expected_heads, q_lens, seq_lens):
    """``module``'s attention over packed sequences (``q_lens`` new tokens of ``seq_lens`` held), read in the latent
    space, against the attention over the K/V its own ``expand_kv`` gives (fp32)."""
    from hfaccel.kv import KVPool
    from hfaccel.kv.hf_cache import PagedKV
    from hfaccel.kv.latent import absorbed_layers
    from hfaccel.kv.layout import AttentionKV, ModelLayout

    config = module.config
    rank, rope_dim, width = config.kv_lora_rank, config.qk_rope_head_dim, module.qk_head_dim
    layout = ModelLayout(1, {0: AttentionKV(1, rank, rope_dim, expanded_dim=max(width, module.v_head_dim))})
    heads = absorbed_layers(torch.nn.ModuleList([module]), layout)[0]
    assert (heads.heads, heads.nope, heads.value) == expected_heads
    num_heads, sequences = heads.heads, list(range(len(seq_lens)))
    pool = KVPool(layout, num_blocks=8, block_size=4, device=DEVICE, dtype=dtype)
    pool.reserve(sequences, seq_lens)
    latent = _random(1, 1, sum(seq_lens), rank, dtype=dtype, seed=9)  # every held token's latents, in sequence order
    rope = _random(1, 1, sum(seq_lens), rope_dim, dtype=dtype, seed=10)
    everything = pool.packed_step(sequences, [0] * len(seq_lens), seq_lens).to(DEVICE)
    pool.write(0, latent[0].transpose(0, 1)[None], rope[0].transpose(0, 1)[None], everything.slot_mapping)
    step = pool.packed_step(sequences, [n - q for n, q in zip(seq_lens, q_lens)], q_lens).to(DEVICE)
    paged = PagedKV(
        **pool.layer_view(0),
        block_tables=step.block_tables,
        seq_lens=step.seq_lens,
        max_seq_len=step.max_seq_len,
        cu_seqlens_q=step.cu_seqlens_q,
        max_seqlen_q=step.max_q_len,
        positions=step.positions,
        latent=heads,
    )
    query = _random(1, num_heads, sum(q_lens), width, dtype=dtype, seed=11)
    with torch.no_grad():  # as the runner calls it, with its packed mask
        out, _ = BACKENDS[backend](module, query, paged, paged, PACKED_MASK, scaling=width**-0.5)
    assert out.shape == (1, sum(q_lens), num_heads, heads.value)
    expanding = copy.deepcopy(module).float()  # the module's own expansion, in fp32
    firsts, starts = [sum(seq_lens[:s]) for s in sequences], [sum(q_lens[:s]) for s in sequences]
    with torch.no_grad():
        for s, (first, held, start) in enumerate(zip(firsts, seq_lens, starts)):
            tokens = slice(first, first + held)
            key, value = expanding.expand_kv(latent[:, :, tokens].float(), rope[:, :, tokens].float())
            rows = slice(start, start + q_lens[s])
            positions = torch.arange(held - q_lens[s], held)
            visible = (torch.arange(held)[None] <= positions[:, None]).to(DEVICE)
            want = _reference(query[0][:, rows], key[0], value[0], width**-0.5, visible)
            assert_close(out[0, rows], want.to(dtype))
