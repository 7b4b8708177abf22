"""Where hfaccel's kernels do not run (a CPU without the Triton interpreter, MPS), ``auto`` attention serves every
dense call by transformers' own SDPA attention and mask, never by the torch reference kernels (those are for
checking: the ``torch`` backend), and ``generate()`` runs transformers' loop and cache, measured faster there than
hfaccel's decode loop; ``model.hfaccel`` says so. The tokens stay transformers'."""

import pytest
import torch

import hfaccel
from hfaccel.attention import sdpa
from hfaccel.attention.masks import KernelMask
from hfaccel.attention.paths import FLASH, SDPA, TORCH
from hfaccel.kernels import flash_attention_reference
from tests.kernels.helpers import assert_close
from tests.models import ARCHITECTURES, padded_batch, tiny_model

GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture
def no_triton(monkeypatch):
    """A CPU as a user has it: Triton kernels cannot run (the suite otherwise interprets them)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize(
    "mask",
    [
        KernelMask(None, 0, 0, True, None),  # aligned causal prefill: is_causal
        KernelMask(None, 40, 0, True, None),  # a decode step that sees every key: no mask
        KernelMask(torch.tensor([[True] * 41, [False] * 9 + [True] * 32]), 40, 0, True, None),  # padded decode
        KernelMask(None, 40, 0, True, 16),  # a window that hides keys
        KernelMask(None, 30, 0, True, None),  # a chunk after cached keys
        KernelMask(None, 0, 0, False, None),  # bidirectional
    ],
    ids=["causal", "decode", "padded", "window", "chunk", "bidirectional"],
)
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["", "softcap"])
def test_the_sdpa_route_computes_the_kernels_rule(mask, softcap):
    gen = torch.Generator().manual_seed(0)
    seq_q = 41 if mask.q_offset == 0 else 41 - mask.q_offset
    q = torch.randn(2, 6, seq_q, 24, generator=gen)
    k, v = torch.randn(2, 2, 41, 24, generator=gen), torch.randn(2, 2, 41, 24, generator=gen)
    out = sdpa.sdpa_dense(q, k, v, mask, 0.2, softcap, None)  # [B, Sq, Hq, D]
    expected = flash_attention_reference(
        q,
        k,
        v,
        scale=0.2,
        causal=mask.causal,
        q_offset=mask.q_offset,
        kv_offset=mask.kv_offset,
        key_mask=mask.key_mask,
        sliding_window=mask.sliding_window,
        softcap=softcap,
    )
    assert_close(out, expected)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_auto_attention_on_a_cpu_is_sdpa_and_gives_transformers_tokens(no_triton, arch):
    model = tiny_model(arch)
    batch = padded_batch()
    expected = model.generate(**batch, **GREEDY)
    hfaccel.accelerate(model)
    assert torch.equal(model.generate(**batch, **GREEDY), expected)
    with torch.no_grad():
        model(**batch)  # a dense forward: a padded prefill
    counts = model.hfaccel.attention_paths.counts
    served = {TORCH} if arch == "gemma2" else {SDPA}  # logit softcapping: the eager formula, as transformers runs it
    assert set(counts) == served, counts
    decode = model.hfaccel.decode
    assert decode.path == "transformers" and "faster path on cpu" in decode.reason, decode


def test_the_torch_backend_keeps_hfaccels_loop(no_triton):
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    batch = padded_batch()
    model.generate(**batch, **GREEDY)
    assert model.hfaccel.decode.path == "hfaccel"


def test_the_torch_backend_keeps_the_reference_kernels(no_triton):
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    with torch.no_grad():
        model(**padded_batch())
    assert set(model.hfaccel.attention_paths.counts) == {f"{FLASH} (torch)"}
