"""accelerate(peft_model): LoRA adapters served unmerged by hfaccel's decode loop (switched with PEFT's own API),
merged with merge_lora=True and given back by restore, on an int4 base (QLoRA-style); and what is refused.

Tiny random-weight fp32 models with random non-zero LoRA weights (``init_lora_weights=False``); PEFT's own generate
on an un-accelerated deep copy is the reference. ``attention="torch"`` makes hfaccel's loop serve the calls on a
CPU (``auto`` would leave them to transformers' loop there).
"""

import copy

import pytest
import torch
from torch import nn

import hfaccel
from hfaccel.quant import Int4Linear, quantize_rtn
from tests.models import padded_batch, tiny_model

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


def _lora(rank: int, **extra) -> "peft.LoraConfig":
    return peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False, task_type="CAUSAL_LM", **extra
    )


def _peft_model(arch: str = "llama", ranks: dict[str, int] | None = None, **extra):
    """A PeftModelForCausalLM with one adapter per entry of ``ranks`` (name -> rank), the first active; the same
    weights every time (``tiny_model`` seeds the generator, the LoRA weights are drawn after it)."""
    ranks = ranks or {"default": 8}
    (first, rank), *others = ranks.items()
    model = peft.get_peft_model(tiny_model(arch), _lora(rank, **extra), adapter_name=first)
    for name, other in others:
        model.add_adapter(name, _lora(other, **extra))
    return model.eval()


def _generate(model, batch) -> torch.Tensor:
    return model.generate(**batch, **GREEDY)


def _served_by_hfaccel(model) -> bool:
    return str(model.hfaccel.decode) == "hfaccel"


@pytest.mark.parametrize("arch, rank", [("llama", 8), ("qwen2", 16)])
def test_peft_model_tokens_equal_peft_generate(arch, rank):
    model = _peft_model(arch, {"default": rank})
    batch = padded_batch()
    expected = _generate(copy.deepcopy(model), batch)
    assert hfaccel.accelerate(model, attention="torch") is model
    assert torch.equal(_generate(model, batch), expected)
    assert _served_by_hfaccel(model)
    assert "LoRA: 14 layers, adapter 'default', unmerged" in str(model.hfaccel)


def test_adapters_switched_with_peft_api_between_calls(tmp_path):
    """set_adapter, disable_adapter() and load_adapter after accelerate: each call runs the adapters active then
    (decode steps kept per adapter state: switching back finds the first state's steps again); a call mixing
    adapters per row (adapter_names) runs transformers' loop, each row its adapter's tokens."""
    model = _peft_model(ranks={"one": 8, "two": 16})
    reference = copy.deepcopy(model)
    batch = padded_batch()
    expected_a = _generate(reference, batch)
    reference.set_adapter("two")
    expected_b = _generate(reference, batch)
    with reference.disable_adapter():
        expected_base = _generate(reference, batch)
    assert not torch.equal(expected_a, expected_b) and not torch.equal(expected_a, expected_base)
    reference.save_pretrained(tmp_path, selected_adapters=["two"])

    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(_generate(model, batch), expected_a) and _served_by_hfaccel(model)
    assert torch.equal(model.generate(**batch, **GREEDY, prompt_lookup_num_tokens=3), expected_a)  # speculative
    steps_a = model.hfaccel.session.runner.graphs
    model.set_adapter("two")
    assert torch.equal(_generate(model, batch), expected_b) and _served_by_hfaccel(model)
    assert model.hfaccel.session.runner.graphs is not steps_a
    assert torch.equal(model.generate(**batch, **GREEDY, prompt_lookup_num_tokens=3), expected_b)
    with model.disable_adapter():
        assert torch.equal(_generate(model, batch), expected_base) and _served_by_hfaccel(model)
        assert "adapters disabled" in str(model.hfaccel)
    model.set_adapter("one")
    assert torch.equal(_generate(model, batch), expected_a)
    assert model.hfaccel.session.runner.graphs is steps_a
    model.load_adapter(tmp_path / "two", adapter_name="three")
    model.set_adapter("three")
    assert torch.equal(_generate(model, batch), expected_b) and _served_by_hfaccel(model)

    mixed = model.generate(**batch, **GREEDY, adapter_names=["one", "two", "__base__"])
    assert "adapter_names" in str(model.hfaccel.decode)
    assert torch.equal(mixed, torch.stack([expected_a[0], expected_b[1], expected_base[2]]))


def test_lora_layers_injected_into_an_accelerated_model_are_served():
    """get_peft_model on a model accelerated before: the next call's decode steps are made for the LoRA layers."""
    batch = padded_batch()
    reference = tiny_model("llama")
    torch.manual_seed(1)  # the same LoRA weights
    expected = _generate(peft.get_peft_model(reference, _lora(8)).eval(), batch)
    base = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    _generate(base, batch)
    steps = base.hfaccel.session.runner.graphs
    torch.manual_seed(1)
    model = peft.get_peft_model(base, _lora(8)).eval()
    assert torch.equal(_generate(model, batch), expected) and _served_by_hfaccel(model)
    assert model.hfaccel.session.runner.graphs is not steps


def test_merge_lora_then_restore_gives_back_the_peft_model():
    model = _peft_model("qwen2", {"one": 8, "two": 16})
    reference = copy.deepcopy(model)
    batch = padded_batch()
    expected = _generate(reference, batch)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    modules = dict(model.named_modules())

    hfaccel.accelerate(model, attention="torch", merge_lora=True)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear and q_proj.weight.dtype == torch.float32
    assert torch.equal(_generate(model, batch), expected) and _served_by_hfaccel(model)
    assert "LoRA: 14 layers, adapter 'one' merged into the weights by hfaccel" in str(model.hfaccel)
    model.set_adapter("two")
    with pytest.raises(ValueError, match=r"merged adapters \('one',\).*active adapters \('two',\).*hfaccel.restore"):
        _generate(model, batch)
    model.set_adapter("one")

    assert hfaccel.restore(model) is model and not hasattr(model, "hfaccel")
    assert dict(model.named_modules()) == modules  # the same module objects, in the same places
    restored = model.state_dict()
    assert restored.keys() == state.keys() and all(torch.equal(restored[k], state[k]) for k in state)
    model.set_adapter("two")  # adapters switch again
    reference.set_adapter("two")
    assert torch.equal(_generate(model, batch), _generate(reference, batch))


def test_int4_base_with_16_bit_lora_adapters():
    """quantize="rtn": every LoRA layer's base layer int4, lora_A / lora_B / embeddings / modules_to_save as they
    were; tokens those of the PEFT model whose base weights are their RTN int4 values, dequantized."""
    group_size = 32
    model = _peft_model(modules_to_save=["lm_head"])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name.endswith(".base_layer"):
                module.weight.copy_(quantize_rtn(module.weight, group_size).dequantize())
    batch = padded_batch()
    expected = _generate(reference, batch)

    hfaccel.accelerate(model, attention="torch", quantize="rtn", group_size=group_size)
    int4 = {name for name, module in model.named_modules() if isinstance(module, Int4Linear)}
    assert len(int4) == 14 and all(name.endswith(".base_layer") for name in int4)
    kept = [
        module
        for name, module in model.named_modules()
        if ".lora_" in name or "modules_to_save" in name or "original_module" in name or name.endswith("embed_tokens")
    ]
    assert kept and not any(isinstance(module, Int4Linear) for module in kept)
    assert torch.equal(_generate(model, batch), expected) and _served_by_hfaccel(model)


def _unchanged(model) -> bool:
    """Nothing of accelerate stayed on a model after it raised."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    return (
        base.config._attn_implementation == "sdpa"
        and "hfaccel" not in base.__dict__
        and "generate" not in base.__dict__
    )


def test_what_is_not_supported_says_so_and_changes_nothing():
    plain = tiny_model("llama")
    with pytest.raises(
        ValueError,
        match="merge_lora=True merges the LoRA adapters of a PEFT model.*LlamaForCausalLM has no LoRA layers",
    ):
        hfaccel.accelerate(plain, merge_lora=True)
    assert _unchanged(plain)

    dora = _peft_model(use_dora=True)
    with pytest.raises(
        ValueError, match="plain LoRA adapters; adapter 'default' on 'model.layers.0.self_attn.q_proj' is DoRA"
    ):
        hfaccel.accelerate(dora, attention="torch")
    assert _unchanged(dora)
    dora.add_adapter("plain", _lora(8))
    dora.set_adapter("plain")
    hfaccel.accelerate(dora, attention="torch")
    dora.set_adapter("default")  # a DoRA adapter made active after accelerate: refused at the call
    with pytest.raises(ValueError, match="adapter 'default' on 'model.layers.0.self_attn.q_proj' is DoRA"):
        _generate(dora, padded_batch())

    torch.manual_seed(0)
    prompt = peft.get_peft_model(
        tiny_model("llama"), peft.PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")
    )
    with pytest.raises(ValueError, match=r"LoRA adapters \(peft_type LORA\).*'default': 'PROMPT_TUNING'"):
        hfaccel.accelerate(prompt)
    assert _unchanged(prompt)

    torch.manual_seed(0)
    embedding = peft.get_peft_model(
        tiny_model("llama"),
        peft.LoraConfig(r=8, target_modules=[*TARGETS, "embed_tokens"], init_lora_weights=False, task_type="CAUSAL_LM"),
    )
    modules = dict(embedding.named_modules())
    with pytest.raises(ValueError, match="cannot merge 'model.embed_tokens': its base layer is Embedding"):
        hfaccel.accelerate(embedding, attention="torch", merge_lora=True)
    with pytest.raises(ValueError, match="quantize='awq'.*use quantize='rtn', or merge_lora=True"):
        hfaccel.accelerate(embedding, attention="torch", quantize="awq")
    assert _unchanged(embedding) and dict(embedding.named_modules()) == modules
