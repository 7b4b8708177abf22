"""A model loaded 4-bit / 8-bit with bitsandbytes through transformers: accelerate() serves its attention and
leaves the bitsandbytes layers as they are (the bitsandbytes CPU backend runs them here)."""

import pytest
import torch
import transformers

import hfaccel
from tests.models import padded_batch

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("bnb-source")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("bits", [4, 8])
def test_accelerate_keeps_bitsandbytes_layers(model_dir, bits):
    spec = (
        transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        if bits == 4
        else transformers.BitsAndBytesConfig(load_in_8bit=True)
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=spec, device_map="cpu", attn_implementation="sdpa"
    )
    layer_type = type(model.model.layers[0].self_attn.q_proj)
    assert layer_type in (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    batch = {key: value.cpu() for key, value in padded_batch().items()}  # bitsandbytes' CPU backend
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="triton")
    assert model.hfaccel.active
    assert type(model.model.layers[0].self_attn.q_proj) is layer_type
    assert torch.equal(model.generate(**batch, **kwargs), expected)
