"""flash_attention (Triton, through the interpreter) vs flash_attention_reference, and sm_90 compilation."""

import importlib

import pytest
import torch

from hfaccel.kernels import flash_attention, flash_attention_reference
from hfaccel.kernels.flash_attention import pick_config, visibility_mask
from tests.devices import on_device
from tests.kernels.helpers import TRITON_TYPES, assert_close, compile_sm90

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


def _check(q, k, v, **kwargs):
    out = on_device(flash_attention, q, k, v, backend="triton", **kwargs)
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
    ],
    ids=lambda f: "+".join(f),
)
def test_masking_features_match_reference(features, dtype):
    shape = (3, 8, 2, 123, 300, 64, 177)
    q, k, v = _inputs(shape, dtype)
    kwargs = dict(features)
    if "key_mask" in kwargs:
        kwargs["key_mask"] = _left_padding(3, 300, kwargs["key_mask"])
    _check(q, k, v, q_offset=shape[6], **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_with_padding_and_window(dtype):
    shape = (4, 8, 2, 1, 300, 128, 299)
    q, k, v = _inputs(shape, dtype)
    _check(q, k, v, q_offset=299, key_mask=_left_padding(4, 300, (0, 1, 150, 298)), sliding_window=100)


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


def test_reference_matches_naive_softmax_attention():
    """The reference itself against the textbook formula with repeated K/V and an explicit mask."""
    q, k, v = _inputs((2, 6, 3, 5, 12, 32, 7), torch.float32)
    key_mask = _left_padding(2, 12, (4, 0))
    ref = flash_attention_reference(q, k, v, q_offset=7, key_mask=key_mask, sliding_window=6, softcap=3.0)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 3.0 * torch.tanh((q @ kr.transpose(-1, -2)) * 32 ** -0.5 / 3.0)
    visible = visibility_mask(2, 5, 12, causal=True, q_offset=7, kv_offset=0, key_mask=key_mask,
                              sliding_window=6, device=q.device)
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vr
    assert_close(ref, expected.transpose(1, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=(2, 4, 5, 64), k=(2, 3, 5, 64)), "multiple of KV heads"),
        (dict(q=(2, 4, 5, 64), k=(1, 2, 5, 64)), "batch=2"),
        (dict(q=(2, 4, 5, 320), k=(2, 2, 5, 320)), "head_dim must be at most 256"),
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


def test_triton_backend_without_gpu_or_interpreter_raises(monkeypatch):
    q, k, v = _inputs((1, 2, 2, 3, 3, 64, 0), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        flash_attention(q, k, v, backend="triton")
    assert_close(flash_attention(q, k, v), flash_attention_reference(q, k, v))  # auto -> reference


# Every configuration pick_config can launch: each dtype and supported head dim, at every tile height
# (rows per (batch, KV head) of 1, 24, 48 and thousands select BLOCK_M 16, 32, 64 and the maximum).
SM90_CASES = [(dtype, head_dim, rows) for dtype in DTYPES for head_dim in (64, 80, 96, 128, 256)
              for rows in (1, 24, 48, 4096)]


def _sm90_job(dtype, head_dim, rows, all_features=True):
    cfg = pick_config(head_dim, dtype, rows)
    ptr = "*" + TRITON_TYPES[dtype]
    signature = {name: "i32" for name in ("num_kv_heads", "seq_q", "seq_kv", "head_dim", "q_offset",
                                          "kv_offset", "window")}
    signature.update({name: "i32" for name in flash_module._flash_attention_kernel.arg_names
                      if name.startswith("stride_")})
    signature.update(Q=ptr, K=ptr, V=ptr, O=ptr, KEY_MASK="*i1", score_scale="fp32", softcap_log2="fp32")
    constexprs = dict(GROUP=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()), IS_CAUSAL=True,
                      HAS_WINDOW=all_features, HAS_SOFTCAP=all_features, HAS_KEY_MASK=all_features,
                      UPCAST=False, IEEE_FP32=dtype == torch.float32)
    return dict(module="hfaccel.kernels.flash_attention", kernel="_flash_attention_kernel",
                signature=signature, constexprs=constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@pytest.fixture(scope="module")
def sm90_results():
    jobs = [_sm90_job(*case) for case in SM90_CASES]
    jobs.append(_sm90_job(torch.float16, 128, 4096, all_features=False))
    return compile_sm90(jobs)


@pytest.mark.parametrize("index", range(len(SM90_CASES) + 1))
def test_compiles_for_sm90(index, sm90_results):
    result = sm90_results[index]
    case = SM90_CASES[index] if index < len(SM90_CASES) else "fp16 D=128, no optional features"
    assert result["ok"], f"{case}: {result.get('error')}"
    assert result["shared"] <= 227 * 1024, f"{case}: {result['shared']} bytes of shared memory"
