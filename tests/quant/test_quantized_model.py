"""Int4Linear in a model: RTN quantization, accelerate(quantize=...), save -> load round trips per format."""

import json

import pytest
import torch

import hfaccel
from hfaccel.quant import Int4Linear, quantize_rtn
from tests.devices import DEVICE
from tests.helpers import quant_llama
from tests.models import padded_batch


def test_int4_linear_equals_dequantized_linear():
    linear = torch.nn.Linear(256, 72, bias=True).to(DEVICE)
    weight = quantize_rtn(linear.weight, 64)
    module = Int4Linear.from_weight(weight, linear.bias)
    x = torch.randn(3, 5, 256, device=DEVICE)
    expected = x @ weight.dequantize().t() + linear.bias
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    assert "bits=4" in repr(module) and "group_size=64" in repr(module)


def test_rtn_error_is_bounded_by_half_a_step():
    """Half a step, plus what rounding the scale to fp16 (relative 2^-11, over 15 steps) adds at the range ends."""
    weight = torch.randn(64, 256)
    quantized = quantize_rtn(weight, 128)
    steps = quantized.scales.float().repeat_interleave(128, 0).t()  # [N, K]
    assert ((quantized.dequantize() - weight).abs() <= steps * (0.5 + 15 * 2**-11) + 1e-6).all()


def test_quantize_replaces_linears_but_not_the_head():
    model = hfaccel.quantize(quant_llama(), "rtn", group_size=64)
    names = [n for n, m in model.named_modules() if isinstance(m, Int4Linear)]
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)
    with pytest.raises(ValueError, match="method must be one of"):
        hfaccel.quantize(quant_llama(), "nf4")


def test_accelerate_with_quantize_generates_like_the_quantized_model():
    reference = hfaccel.quantize(quant_llama(), "rtn", group_size=64)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = reference.generate(**batch, **kwargs)
    model = hfaccel.accelerate(quant_llama(), quantize="rtn", group_size=64, attention="triton")
    assert torch.equal(model.generate(**batch, **kwargs), expected)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_save_then_load_is_bit_exact(tmp_path, fmt):
    model = hfaccel.quantize(quant_llama(dtype=torch.float16, tie_word_embeddings=True), "rtn", group_size=64)
    hfaccel.save_quantized(model, tmp_path, format=fmt)
    spec = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert spec["quant_method"] == fmt and spec["bits"] == 4 and spec["group_size"] == 64
    loaded = hfaccel.load_quantized(tmp_path, dtype=torch.float16, device=DEVICE)
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            other = loaded.get_submodule(name)
            assert isinstance(other, Int4Linear)
            assert torch.equal(other.qweight, module.qweight) and torch.equal(other.scales, module.scales)
            assert torch.equal(other.zeros, module.zeros)
    ids = padded_batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_load_rejects_non_quantized_folder(tmp_path):
    quant_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no quantization_config"):
        hfaccel.load_quantized(tmp_path)
