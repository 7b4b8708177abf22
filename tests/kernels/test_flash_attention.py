"""flash_attention (Triton, through the interpreter) vs flash_attention_reference, and sm_90 compilation."""

import importlib

import pytest
import torch

from hfaccel.kernels import flash_attention, flash_attention_reference
from hfaccel.kernels.flash_attention import (
    FlashConfig,
    candidate_configs,
    default_config,
    pick_config,
    sdpa_preferred,
    visibility_mask,
)
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, assert_close, assert_each_compiles_for_sm90, launch_like

flash_module = importlib.import_module("hfaccel.kernels.flash_attention")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, q_offset): odd sizes, GQA ratios 1/3/4/8, decode
# (seq_q 1) and chunked prefill (seq_q < seq_kv, queries at the end of the keys).
SHAPES = [
    (1, 1, 1, 1, 1, 64, 0),
    (2, 3, 1, 7, 7, 80, 0),
    (2, 8, 2, 123, 123, 96, 0),
    (1, 8, 1, 300, 300, 128, 0),
    (3, 4, 4, 1, 300, 256, 299),
    (2, 6, 2, 7, 130, 64, 123),
    (1, 4, 2, 11, 11, 512, 0),  # Gemma 4's global layers
    (2, 2, 1, 1, 37, 320, 36),
]


def _inputs(shape, dtype, seed=0):
    batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, _ = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, seq_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, seq_kv, head_dim, generator=gen).to(dtype)
    return q, k, v


def _left_padding(batch, seq_kv, pads):
    mask = torch.ones(batch, seq_kv, dtype=torch.bool)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = False
    return mask


def _check(q, k, v, config=None, **kwargs):
    out = on_device(flash_attention, q, k, v, backend="triton", config=config, **kwargs)
    ref = flash_attention_reference(q, k, v, **kwargs)
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    assert out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_matches_reference(shape, dtype):
    q, k, v = _inputs(shape, dtype)
    _check(q, k, v, q_offset=shape[6])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "features",
    [
        {"key_mask": (0, 50, 299)},
        {"sliding_window": 37},
        {"softcap": 5.0},
        {"key_mask": (3, 0, 120), "sliding_window": 64, "softcap": 30.0},
        {"causal": False, "key_mask": (0, 17, 1)},
        {"sinks": True},
        {"sinks": True, "key_mask": (3, 0, 120), "sliding_window": 64},
        {"chunk_size": 53},
        {"chunk_size": 29, "key_mask": (3, 0, 120), "softcap": 30.0, "sinks": True},
    ],
    ids=lambda f: "+".join(f),
)
def test_masking_features_match_reference(features, dtype):
    shape = (3, 8, 2, 123, 300, 64, 177)
    q, k, v = _inputs(shape, dtype)
    kwargs = dict(features)
    if "key_mask" in kwargs:
        kwargs["key_mask"] = _left_padding(3, 300, kwargs["key_mask"])
    if "sinks" in kwargs:
        kwargs["sinks"] = _sinks(8, dtype)
    _check(q, k, v, q_offset=shape[6], **kwargs)


def _sinks(heads: int, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    """One sink logit per query head, some above the scores' range (they then take most of the weight)."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_with_padding_and_window(dtype):
    shape = (4, 8, 2, 1, 300, 128, 299)
    q, k, v = _inputs(shape, dtype)
    _check(q, k, v, q_offset=299, key_mask=_left_padding(4, 300, (0, 1, 150, 298)), sliding_window=100)


def test_chunks_are_transformers_chunked_mask():
    """``chunk_size``'s rule is transformers' chunked causal mask (Llama 4's ``attention_chunk_size``) on a row
    without padding; without causality it is refused."""
    from transformers import masking_utils

    chunked = masking_utils.chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long))
    t = torch.tensor
    want = torch.tensor([[bool(chunked(t(0), t(0), t(i), t(j))) for j in range(17)] for i in range(17)])
    got = visibility_mask(
        1, 17, 17, causal=True, q_offset=0, kv_offset=0, key_mask=None, sliding_window=None, chunk_size=5, device="cpu"
    )[0, 0]
    assert torch.equal(got, want)
    q, k, v = _inputs((1, 2, 1, 4, 4, 16, 0), torch.float32)
    with pytest.raises(ValueError, match="needs causal=True"):
        flash_attention(q, k, v, causal=False, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        flash_attention(q, k, v, chunk_size=0)


def test_fully_masked_rows_are_zero_not_nan():
    shape = (2, 4, 2, 9, 9, 64, 0)
    q, k, v = _inputs(shape, torch.float32)
    key_mask = _left_padding(2, 9, (5, 0))  # row 0: queries 0..4 see only padding
    out = on_device(flash_attention, q, k, v, backend="triton", key_mask=key_mask)
    assert torch.isfinite(out).all()
    assert out[0, :5].abs().max() == 0
    assert_close(out, flash_attention_reference(q, k, v, key_mask=key_mask))


def test_non_contiguous_inputs():
    """transformers hands the kernel transposed views: [B, S, H, D] storage seen as [B, H, S, D]."""
    q = torch.randn(2, 19, 6, 64).transpose(1, 2)
    k = torch.randn(2, 19, 2, 64).transpose(1, 2)
    v = torch.randn(2, 2, 64, 19).transpose(2, 3)
    _check(q, k, v)


def test_sinks_leave_rows_without_keys_at_zero():
    """A query that sees no key gives zeros with sinks too (the sink is attached to no value)."""
    q, k, v = _inputs((2, 4, 2, 9, 9, 64, 0), torch.float32)
    key_mask = _left_padding(2, 9, (5, 0))
    out = on_device(flash_attention, q, k, v, backend="triton", key_mask=key_mask, sinks=_sinks(4, torch.float32))
    assert torch.isfinite(out).all() and out[0, :5].abs().max() == 0


def test_reference_sinks_match_transformers_eager_formula():
    """The reference's sinks against transformers' eager attention with sinks: the sink logit concatenated to each
    row's scores, the softmax over both, the sink's column dropped."""
    q, k, v = _inputs((2, 6, 3, 5, 12, 32, 7), torch.float32)
    sinks = _sinks(6, torch.float32)
    ref = flash_attention_reference(q, k, v, q_offset=7, sliding_window=6, sinks=sinks)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2)) * 32**-0.5
    visible = visibility_mask(
        2, 5, 12, causal=True, q_offset=7, kv_offset=0, key_mask=None, sliding_window=6, device=q.device
    )
    scores = torch.cat([scores.masked_fill(~visible, float("-inf")), sinks.view(1, 6, 1, 1).expand(2, 6, 5, 1)], -1)
    expected = torch.softmax(scores, -1)[..., :-1] @ vr
    assert_close(ref, expected.transpose(1, 2))


def test_reference_matches_naive_softmax_attention():
    """The reference itself against the textbook formula with repeated K/V and an explicit mask."""
    q, k, v = _inputs((2, 6, 3, 5, 12, 32, 7), torch.float32)
    key_mask = _left_padding(2, 12, (4, 0))
    ref = flash_attention_reference(q, k, v, q_offset=7, key_mask=key_mask, sliding_window=6, softcap=3.0)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 3.0 * torch.tanh((q @ kr.transpose(-1, -2)) * 32**-0.5 / 3.0)
    visible = visibility_mask(
        2, 5, 12, causal=True, q_offset=7, kv_offset=0, key_mask=key_mask, sliding_window=6, device=q.device
    )
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vr
    assert_close(ref, expected.transpose(1, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=(2, 4, 5, 64), k=(2, 3, 5, 64)), "multiple of KV heads"),
        (dict(q=(2, 4, 5, 64), k=(1, 2, 5, 64)), "batch=2"),
        (dict(q=(2, 4, 5, 640), k=(2, 2, 5, 640)), "head_dim must be at most 512"),
        (dict(q=(2, 4, 64), k=(2, 2, 5, 64)), "must be 4-D"),
    ],
)
def test_bad_shapes_raise(kwargs, message):
    q = torch.randn(*kwargs["q"])
    k = torch.randn(*kwargs["k"])
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k.clone())


def test_bad_arguments_raise():
    q, k, v = _inputs((2, 4, 2, 5, 5, 64, 0), torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="key_mask must be a bool"):
        flash_attention(q, k, v, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding_window"):
        flash_attention(q, k, v, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        flash_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="one of"):
        flash_attention(q.to(torch.float64), k.double(), v.double())


def test_custom_op_agrees_with_its_schema_and_fake():
    """torch.ops.hfaccel.flash_attention (what an accelerated model's prefill calls): schema, fake implementation and
    autograd registration agree (opcheck) on odd sizes — GQA 3:1, head_dim 40, a key mask, sinks, a window, an
    offset — and it returns the launcher's ``[B, Sq, Hq, D]`` values."""
    from hfaccel.kernels.ops import flash_attention_op

    q, k, v = (t.to(DEVICE) for t in _inputs((2, 3, 1, 5, 9, 40, 4), torch.float32))
    key_mask = _left_padding(2, 9, (0, 2)).to(DEVICE)
    sinks = _sinks(3, torch.float32).to(DEVICE)
    args = (q, k, v, key_mask, 0.3, True, 4, 0, 6, None, None, sinks, "auto")
    torch.library.opcheck(flash_attention_op, args)
    expected = flash_attention_reference(
        q, k, v, scale=0.3, q_offset=4, key_mask=key_mask, sliding_window=6, sinks=sinks
    )
    out = flash_attention_op(*args)
    assert out.shape == (2, 5, 3, 40) and out.is_contiguous()
    assert_close(out.cpu(), expected.cpu())


def test_triton_backend_without_gpu_or_interpreter_raises(monkeypatch):
    q, k, v = _inputs((1, 2, 2, 3, 3, 64, 0), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        flash_attention(q, k, v, backend="triton")
    assert_close(flash_attention(q, k, v), flash_attention_reference(q, k, v))  # auto -> reference


# The loop over a tile's keys runs in three parts: masked blocks where a window starts, whole blocks that every
# row sees (no masks), masked blocks on the diagonal and at the end of the keys. Tiles of 16 make each part
# long: GQA groups that do not divide the tile, windows and offsets that cut blocks, a key mask (the one mask the
# whole blocks still apply), non-causal windows.
SMALL_TILES = FlashConfig(16, 16, 4, 1)
LOOP_CASES = [
    dict(shape=(2, 6, 2, 77, 77, 64, 0)),
    dict(shape=(1, 4, 1, 45, 150, 80, 110), kv_offset=5, sliding_window=33),
    dict(shape=(2, 8, 2, 50, 97, 64, 47), key_mask=(0, 40), softcap=10.0),
    dict(shape=(1, 3, 3, 60, 60, 32, 0), causal=False, sliding_window=20),
    dict(shape=(1, 4, 2, 9, 40, 64, 0), kv_offset=20),  # queries before the keys: some rows see no key
    dict(shape=(2, 6, 2, 70, 131, 64, 61), chunk_size=23),  # chunks that cut tiles and blocks
    dict(shape=(1, 4, 1, 45, 150, 80, 110), kv_offset=5, chunk_size=40, sliding_window=30),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: "x".join(map(str, c["shape"])))
def test_whole_block_loop_with_small_tiles(case, dtype):
    kwargs = {key: value for key, value in case.items() if key != "shape"}
    q, k, v = _inputs(case["shape"], dtype)
    if "key_mask" in kwargs:
        kwargs["key_mask"] = _left_padding(q.shape[0], k.shape[2], kwargs["key_mask"])
    _check(q, k, v, q_offset=case["shape"][6], config=SMALL_TILES, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tma_descriptors_match_reference(dtype):
    """K/V through TMA descriptors (real ones on a GPU, emulated by the interpreter on the CPU): transformers'
    layout ([B, S, H, D] storage seen as [B, H, S, D]), head dim 80 under a 128-wide box (zeros past the end), keys
    past the sequence end (zeros)."""
    config = FlashConfig(32, 16, 4, 2, tma=True)
    q = torch.randn(2, 37, 6, 80).to(dtype).transpose(1, 2)
    k = torch.randn(2, 53, 2, 80).to(dtype).transpose(1, 2)
    v = torch.randn(2, 53, 2, 80).to(dtype).transpose(1, 2)
    k_arg, v_arg = flash_module._kv_arguments(k.to(DEVICE), v.to(DEVICE), config, 128)
    assert not isinstance(k_arg, torch.Tensor) and not isinstance(v_arg, torch.Tensor)
    _check(q, k, v, q_offset=16, config=config, key_mask=_left_padding(2, 53, (0, 9)), sliding_window=21)


def test_tma_falls_back_to_pointers_where_descriptors_cannot_read():
    config = FlashConfig(32, 16, 4, 2, tma=True)
    storage = torch.randn(2 * 2 * 40 * 64 + 1).half()
    k = storage[1:].view(2, 2, 40, 64)  # base 2 bytes past 16-byte alignment
    v = torch.randn(2, 2, 40, 64).half()
    assert flash_module._kv_arguments(k, v, config, 64) == (k, v)
    assert flash_module._kv_arguments(v.float(), v.float(), config, 64)[0] is not None  # fp32: pointers
    assert isinstance(flash_module._kv_arguments(v.float(), v.float(), config, 64)[0], torch.Tensor)
    q = torch.randn(2, 4, 40, 64).half()
    _check(q, k, v, config=config)


@pytest.mark.parametrize(
    "config",
    [c for d in (64, 128, 256, 512) for c in candidate_configs(d, torch.float16)],
    ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'tma' if c.tma else ''}",
)
def test_every_tunable_config_matches_reference(config):
    """Each configuration a tuned table may pick, at the largest head dim of its class (fp16, GQA, padding)."""
    head_dim = next(d for d in (64, 128, 256, 512) if config in candidate_configs(d, torch.float16))
    q, k, v = _inputs((1, 4, 2, 150, 150, head_dim, 0), torch.float16)
    _check(q, k, v, key_mask=_left_padding(1, 150, (3,)), config=config)


def test_tuned_table_picks_long_calls_configs(tuned_table):
    key = flash_module.table_key(128, 4, 2048, torch.float16)
    tuned_table(
        {
            "flash_attention": {
                key: dict(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True, us=10.0, sdpa_us=12.0)
            }
        }
    )
    assert key == "d128_g4_s2048_dtypefloat16"
    assert pick_config(128, torch.float16, 2000, 4, "cuda") == FlashConfig(64, 128, 4, 3, tma=True)
    assert pick_config(128, torch.float16, 2000, 4, "cpu") == default_config(128, torch.float16, 8000)
    assert pick_config(128, torch.float16, 16, 4, "cuda") == default_config(128, torch.float16, 64)  # short
    assert pick_config(128, torch.float32, 2000, 4, "cuda") == default_config(128, torch.float32, 8000)
    assert pick_config(128, torch.float16, 9000, 4, "cuda") == FlashConfig(64, 128, 4, 3, tma=True)  # nearest: s2048


def test_sdpa_preference_follows_the_tuned_measurements(tuned_table):
    fast = flash_module.table_key(64, 4, 4096, torch.bfloat16)
    slow = flash_module.table_key(64, 4, 1024, torch.bfloat16)
    entry = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    tuned_table(
        {"flash_attention": {fast: dict(entry, us=80.0, sdpa_us=100.0), slow: dict(entry, us=30.0, sdpa_us=20.0)}}
    )
    assert not sdpa_preferred(64, 4, 3000, torch.bfloat16, "cuda")  # hfaccel measured faster
    assert sdpa_preferred(64, 4, 1000, torch.bfloat16, "cuda")  # SDPA measured faster
    assert sdpa_preferred(64, 4, 3000, torch.float16, "cuda")  # not measured: SDPA


# Every configuration a call can launch with: what default_config gives each dtype and supported head dim at
# every tile height (rows per (batch, KV head) of 1, 24, 48 and thousands select BLOCK_M 16, 32, 64 and the
# maximum), and every candidate a tuned table can hold (per head-dim class, with and without TMA).
SM90_CASES = [
    (dtype, head_dim, default_config(head_dim, dtype, rows), True)
    for dtype in DTYPES
    for head_dim in (64, 80, 96, 128, 256, 320, 512)
    for rows in (1, 24, 48, 4096)
]
SM90_CASES += [(torch.float16, 128, default_config(128, torch.float16, 4096), False)]  # no optional features
SM90_CASES += [
    (torch.float16, head_dim, cfg, True)
    for head_dim in (64, 128, 256, 512)
    for cfg in candidate_configs(head_dim, torch.float16)
]
SM90_CASES += [(torch.bfloat16, 80, FlashConfig(128, 64, 8, 3, tma=True), True)]


def _sm90_job(dtype, head_dim, cfg, all_features):
    ptr = "*" + TRITON_TYPES[dtype]
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    kv = f"tensordesc<{TRITON_TYPES[dtype]}[1,1,{cfg.block_n},{block_d}]>" if cfg.tma else ptr
    signature = {
        name: "i32"
        for name in ("num_kv_heads", "seq_q", "seq_kv", "head_dim", "q_offset", "kv_offset", "window", "chunk")
    }
    signature.update(
        {name: "i32" for name in flash_module._flash_attention_kernel.arg_names if name.startswith("stride_")}
    )
    signature.update(Q=ptr, K=kv, V=kv, O=ptr, KEY_MASK="*i1", SINKS="*fp32", score_scale="fp32", softcap_log2="fp32")
    constexprs = dict(
        GROUP=4,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        TMA=cfg.tma,
        IS_CAUSAL=True,
        HAS_WINDOW=all_features,
        HAS_CHUNK=all_features,
        HAS_SOFTCAP=all_features,
        HAS_KEY_MASK=all_features,
        HAS_SINKS=all_features,
        UPCAST=False,
        IEEE_FP32=dtype == torch.float32,
    )
    kernel = flash_module._flash_attention_kernel
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_ms")
    return dict(
        module="hfaccel.kernels.flash_attention",
        kernel="_flash_attention_kernel",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_like(kernel, signature, constexprs, unit),
    )


def test_compiles_for_sm90():
    def check(case, result):
        assert result["shared"] <= 227 * 1024, f"{result['shared']} bytes of shared memory"

    assert_each_compiles_for_sm90(SM90_CASES, [_sm90_job(*case) for case in SM90_CASES], check)
