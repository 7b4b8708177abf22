"""accelerate / restore behaviour: per-instance patching, pipelines, fallbacks and bad input."""

import ast
import importlib
from pathlib import Path

import pytest
import torch
import transformers

import hfaccel
from tests.devices import DEVICE
from tests.helpers import word_tokenizer
from tests.models import padded_batch, tiny_model, wide_head_model


def _greedy(model, batch, tokens=8):
    return model.generate(**batch, max_new_tokens=tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


def test_model_hfaccel_describes_the_patch():
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    returned = hfaccel.accelerate(model, attention="triton")
    assert returned is model
    assert model.hfaccel.active
    assert model.hfaccel.attention == "triton"
    assert model.hfaccel.attn_implementation == "hfaccel_triton"
    assert model.hfaccel.original_attn_implementation == "sdpa"
    assert model.config._attn_implementation == "hfaccel_triton"
    assert "sdpa" in str(model.hfaccel) and "hfaccel_triton" in str(model.hfaccel)


def test_restore_gives_back_original_behaviour():
    model = tiny_model("mistral")
    batch = padded_batch()
    expected = _greedy(model, batch)
    hfaccel.accelerate(model)
    hfaccel.restore(model)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model, "hfaccel")
    assert torch.equal(_greedy(model, batch), expected)
    assert hfaccel.restore(model) is model  # restoring an unpatched model is a no-op


def test_restore_puts_back_eager():
    model = tiny_model("gemma2")
    assert model.config._attn_implementation == "eager"
    hfaccel.restore(hfaccel.accelerate(model))
    assert model.config._attn_implementation == "eager"


def test_second_model_is_unaffected():
    patched, other = tiny_model("llama"), tiny_model("llama", seed=3)
    batch = padded_batch()
    expected = _greedy(other, batch)
    hfaccel.accelerate(patched)
    assert other.config._attn_implementation == "sdpa"
    assert not hasattr(other, "hfaccel")
    assert torch.equal(_greedy(other, batch), expected)
    assert transformers.AttentionInterface._global_mapping["sdpa"] is not None
    assert "hfaccel" not in transformers.AttentionInterface._global_mapping["sdpa"].__module__


def test_accelerate_twice_is_idempotent_and_switches_backend():
    model = tiny_model("qwen3")
    batch = padded_batch()
    expected = _greedy(model, batch)
    hfaccel.accelerate(model)
    hfaccel.accelerate(model)
    assert model.hfaccel.original_attn_implementation == "sdpa"  # not "hfaccel"
    hfaccel.accelerate(model, attention="torch")
    assert model.config._attn_implementation == "hfaccel_torch"
    assert torch.equal(_greedy(model, batch), expected)
    hfaccel.restore(model)
    assert model.config._attn_implementation == "sdpa"


def test_pipeline_output_equals_unpatched_pipeline(tmp_path):
    model = tiny_model("llama")
    tokenizer = word_tokenizer(model.config.vocab_size)
    prompts = ["a b c", "d e f g h i"]
    kwargs = dict(max_new_tokens=10, do_sample=False)
    expected = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts, **kwargs)
    hfaccel.accelerate(model, attention="triton")
    got = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts, **kwargs)
    assert got == expected


def test_unsupported_architecture_falls_back_with_warning():
    model = wide_head_model()
    original = model.config._attn_implementation
    with pytest.warns(UserWarning, match="head_dim 640"):
        hfaccel.accelerate(model)
    assert not model.hfaccel.active
    assert model.config._attn_implementation == original
    assert "head_dim 640, larger than the kernels' maximum 512" in model.hfaccel.fallback_reason
    hfaccel.restore(model)
    assert model.config._attn_implementation == original


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # positions counted from the padding index (its sinusoid table's row 0 is the padding's)
        ("kosmos-2.5", "other logits than transformers' own forward of each sequence alone"),
        # the prompt attended both ways (the Gemma backbone's is_causal is False)
        ("paligemma", "layer 0's attention is not causal"),
    ],
)
def test_a_model_whose_forward_is_not_what_hfaccel_passes_is_declined(model_type, reason):
    """A model hfaccel's packed forward would compute otherwise than transformers (the trial's logits against
    transformers' own forward, and attention modules that say they are not causal) stays on transformers' path with
    the reason: its tokens for a prompt alone, where transformers' padded batches happen to agree with hfaccel's."""
    from tests.hf.tiny_configs import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_config(model_type)).eval().to(DEVICE)
    ids = torch.arange(3, 12, device=DEVICE)[None]
    expected = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with pytest.warns(UserWarning, match="keeps its"):
        hfaccel.accelerate(model, attention="torch")
    assert not model.hfaccel.active and reason in model.hfaccel.fallback_reason, model.hfaccel.fallback_reason
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)


def test_attention_sinks_are_served():
    """gpt-oss's sinks: one more logit per query head in hfaccel's kernels' softmax; its alternating sliding and
    full layers; its experts as transformers runs them."""
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=8,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval().to(DEVICE)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (they start at zero)
    batch = padded_batch(vocab_size=64)
    expected = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
    hfaccel.accelerate(model, attention="torch")
    assert model.hfaccel.active
    assert torch.equal(model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)
    assert str(model.hfaccel.decode) == "hfaccel"


def test_chunked_attention_mask_uses_dense_path():
    """A mask pattern the kernels lack (Llama4-style chunked attention) is served exactly from a dense mask."""
    from transformers import masking_utils

    from hfaccel.attention import kernel_mask

    fn = masking_utils.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    got = kernel_mask(batch_size=2, q_length=5, kv_length=5, mask_function=fn, local_size=3)
    expected = masking_utils.sdpa_mask(
        batch_size=2, q_length=5, kv_length=5, mask_function=fn, allow_is_causal_skip=False
    )
    assert isinstance(got, torch.Tensor) and torch.equal(got, expected)


@pytest.mark.parametrize("attention", ["flash", "cuda", None, ""])
def test_bad_attention_argument(attention):
    with pytest.raises(ValueError, match="attention must be one of"):
        hfaccel.accelerate(tiny_model("llama"), attention=attention)


def test_triton_on_a_device_that_cannot_run_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        hfaccel.accelerate(model, attention="triton")
    assert model.config._attn_implementation == "sdpa"  # nothing half-patched
    assert not hasattr(model, "hfaccel")


def test_non_causal_lm_is_rejected():
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    with pytest.raises(ValueError, match="causal language model"):
        hfaccel.accelerate(bert)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hfaccel.accelerate(torch.nn.Linear(2, 2))


def test_save_pretrained_of_accelerated_model_reloads_without_hfaccel(tmp_path):
    model = hfaccel.accelerate(tiny_model("llama"))
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not reloaded.config._attn_implementation.startswith("hfaccel")


def test_kernel_layer_imports_only_torch_and_triton():
    """hfaccel.kernels must stay free of transformers and of the integration layer (DESIGN.md)."""
    package = Path(importlib.import_module("hfaccel.kernels").__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("transformers"), f"{path.name} imports {name}"
                assert not name.startswith("hfaccel") or name.startswith("hfaccel.kernels"), (
                    f"{path.name} imports {name}"
                )


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "opt", "codegen"])
def test_beam_search_on_a_config_without_kv_heads_keeps_transformers_tokens(model_type):
    """Beam search runs transformers' loop over a PagedCache sized from the config: a config that names no
    ``num_key_value_heads`` (GPT-2, GPT-NeoX, OPT, CodeGen; transformers 5.24 gives every config a per-layer view)
    holds its attention heads — transformers' tokens, not an error."""
    from tests.hf.tiny_configs import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=96)).eval().to(DEVICE)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=5, num_beams=2, do_sample=False, pad_token_id=0)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    assert model.hfaccel.decode.path == "transformers"
