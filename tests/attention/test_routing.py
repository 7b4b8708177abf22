"""Which path serves a dense attention call (SDPA where it computes exactly the call and the tuned table says it
is faster, hfaccel's kernels otherwise), and how ``model.hfaccel.attention_paths`` counts the paths."""

import pytest
import torch

import hfaccel
from hfaccel.attention import functions, sdpa
from hfaccel.attention.masks import KernelMask
from hfaccel.attention.paths import FLASH, PAGED, PATHS_ATTRIBUTE, SDPA, AttentionPaths
from hfaccel.kernels import flash_attention_reference
from hfaccel.kernels.flash_attention import table_key
from tests.devices import DEVICE
from tests.kernels.helpers import assert_close
from tests.models import padded_batch, tiny_model

PLAIN = KernelMask(key_mask=None, q_offset=0, kv_offset=0, causal=True, sliding_window=None)


def _qkv(batch=2, heads=6, kv_heads=2, seq=37, kv_seq=None, head_dim=64, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, kv_seq or seq, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, kv_seq or seq, head_dim, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize(
    "mask, softcap, kv_seq, expected",
    [
        (PLAIN, None, None, True),
        (KernelMask(None, 5, 5, True, None), None, None, True),  # same offsets: still aligned
        (KernelMask(None, 0, 0, True, 37), None, None, True),  # a window as long as the keys hides nothing
        (KernelMask(None, 0, 0, True, 36), None, None, False),
        (KernelMask(torch.ones(2, 37, dtype=torch.bool), 0, 0, True, None), None, None, False),  # padding
        (KernelMask(None, 0, 0, False, None), None, None, False),
        (PLAIN, 30.0, None, False),  # softcap
        (KernelMask(None, 13, 0, True, None), None, 50, False),  # a chunk after cached keys (bottom-right causal)
        (KernelMask(None, 3, 0, True, None), None, None, False),  # offset queries
    ],
)
def test_sdpa_computes_only_aligned_causal_calls_without_masks(mask, softcap, kv_seq, expected):
    q, k, _ = _qkv(kv_seq=kv_seq)
    assert sdpa.sdpa_computes(q, k, mask, softcap) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_sdpa_route_computes_the_reference(dtype):
    q, k, v = _qkv(batch=2, heads=9, kv_heads=3, seq=41, head_dim=80, dtype=dtype)
    out = sdpa.sdpa_causal(q, k, v, 0.1)
    assert out.shape == (2, 41, 9, 80) and out.is_contiguous()
    assert_close(out, flash_attention_reference(q, k, v, scale=0.1))


def test_prefill_route_follows_the_tuned_table(tuned_table):
    """On CUDA: SDPA where the table measured it faster or has no bucket, hfaccel where hfaccel was faster; never
    for other backends, fp32, or calls SDPA does not compute. Off CUDA always hfaccel's kernel."""
    q, k, _ = (t.to(DEVICE) for t in _qkv(heads=8, kv_heads=2, seq=600, head_dim=64, dtype=torch.float16))
    entry = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    tuned_table({"flash_attention": {table_key(64, 4, 600, torch.float16): dict(entry, us=9.0, sdpa_us=10.0)}})
    on_cuda = DEVICE.type == "cuda"
    assert sdpa.prefill_route("auto", q, k, PLAIN, None) == FLASH  # hfaccel measured faster
    tuned_table({"flash_attention": {table_key(64, 4, 600, torch.float16): dict(entry, us=11.0, sdpa_us=10.0)}})
    assert sdpa.prefill_route("auto", q, k, PLAIN, None) == (SDPA if on_cuda else FLASH)
    tuned_table({})
    assert sdpa.prefill_route("auto", q, k, PLAIN, None) == (SDPA if on_cuda else FLASH)  # not measured
    assert sdpa.prefill_route("triton", q, k, PLAIN, None) == FLASH
    assert sdpa.prefill_route("auto", q.float(), k.float(), PLAIN, None) == FLASH
    assert sdpa.prefill_route("auto", q, k, PLAIN, 5.0) == FLASH


def test_routed_calls_run_sdpa_and_are_counted(monkeypatch):
    """The attention function with the router's answer forced: SDPA serves plain calls (same result as the
    reference), hfaccel's kernel the others, and the module's AttentionPaths counts both."""
    module = torch.nn.Module()
    paths = AttentionPaths()
    setattr(module, PATHS_ATTRIBUTE, paths)
    monkeypatch.setattr(
        functions,
        "prefill_route",
        lambda backend, query, key, mask, softcap, sinks: (
            SDPA if sdpa.sdpa_computes(query, key, mask, softcap, sinks) else FLASH
        ),
    )
    q, k, v = _qkv()
    out, _ = functions.auto_attention(module, q, k, v, PLAIN, scaling=0.125)
    assert_close(out, flash_attention_reference(q, k, v, scale=0.125))
    window = KernelMask(None, 0, 0, True, 9)
    out, _ = functions.auto_attention(module, q, k, v, window)
    assert_close(out, flash_attention_reference(q, k, v, sliding_window=9))
    assert paths.counts == {SDPA: 1, f"{FLASH} (triton)": 1} and paths.last == f"{FLASH} (triton)"
    assert str(paths) == f"sdpa 1, {FLASH} (triton) 1 (last: {FLASH} (triton))"


def test_accelerated_model_reports_its_attention_paths():
    model = hfaccel.accelerate(tiny_model("llama"))
    paths = model.hfaccel.attention_paths
    assert str(paths) == "no eager attention call yet"
    model(**padded_batch())  # autograd: the exact torch path, one call per layer
    assert paths.counts == {"torch": 2}
    with torch.no_grad():
        model(**padded_batch())  # padded: hfaccel's flash kernel (compiled on CUDA, interpreted on the CPU)
    assert paths.counts == {"torch": 2, f"{FLASH} (triton)": 2} and paths.last == f"{FLASH} (triton)"
    model.generate(**padded_batch(), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert paths.counts[f"{PAGED} (triton)"] == 2 * 3  # the packed prompts, then 2 decode steps (not compiled)
    paths.counts.clear()
    one = padded_batch(lengths=(9,))
    expected = tiny_model("llama").generate(**one, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**one, max_new_tokens=3, do_sample=False, pad_token_id=0), expected)
    # one sequence's whole prompt is a dense causal prefill (the flash kernel; SDPA where routed on CUDA)
    assert paths.counts[f"{FLASH} (triton)"] + paths.counts[SDPA] == 2 and paths.counts[f"{PAGED} (triton)"] == 4
    assert "attention calls:" in str(model.hfaccel)
    hfaccel.restore(model)
    assert not any(PATHS_ATTRIBUTE in vars(m) for m in model.modules())
