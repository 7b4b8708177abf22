"""Fp8Linear in a model: ``quantize(model, "fp8")`` and ``accelerate(quantize="fp8")``, and the fp8 checkpoint
formats users download — compressed-tensors (written by ``save_quantized(format="fp8")``, read back by hfaccel and by
transformers' own loader), block FP8 (transformers' ``FineGrainedFP8Config`` layout: ``weight_scale_inv`` per block)
and FBGEMM fp8 — each giving the greedy tokens of the same model with its weights dequantized to fp32 (Llama and
Qwen3, a left-padded batch)."""

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

import hfaccel
from hfaccel.kernels.fp8 import FP8_DTYPE
from hfaccel.quant import Fp8Linear, replace_module
from tests.models import padded_batch, tiny_model

GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
ARCHITECTURES = ["llama", "qwen3"]


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each Fp8Linear replaced by an fp32 Linear holding its dequantized weight."""
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if isinstance(module, Fp8Linear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantized(torch.float32)
            if module.bias is not None:
                linear.bias.data = module.bias.data.float()
            replace_module(copied, name, linear)
    return copied


def test_fp8_linear_equals_its_dequantized_weight():
    linear = torch.nn.Linear(200, 77, bias=True)
    module = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 5, 200)
    torch.testing.assert_close(module(x), x @ module.dequantized().t() + linear.bias, atol=1e-5, rtol=1e-5)
    error = (module.dequantized() - linear.weight).abs().max(dim=1).values
    assert (error <= linear.weight.abs().max(dim=1).values / 16).all()  # e4m3: 3 mantissa bits
    assert "fp8 e4m3 per channel" in repr(module)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantize_and_accelerate_give_the_dequantized_models_tokens(arch):
    model = hfaccel.quantize(tiny_model(arch), "fp8")
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 2 * 7
    assert not isinstance(model.lm_head, Fp8Linear)
    batch = padded_batch()
    expected = dequantized_copy(model).generate(**batch, **GREEDY)
    assert torch.equal(model.generate(**batch, **GREEDY), expected)
    accelerated = hfaccel.accelerate(tiny_model(arch), quantize="fp8", attention="triton", compile=False)
    assert torch.equal(accelerated.generate(**batch, **GREEDY), expected)
    assert str(accelerated.hfaccel.decode) == "hfaccel"
    assert "14 × fp8 e4m3 per channel" in str(accelerated.hfaccel)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compressed_tensors_checkpoint_round_trip(tmp_path, arch):
    """save_quantized(format="fp8") writes compressed-tensors; hfaccel reads it back bit-exactly, transformers' own
    loader (the compressed-tensors package) reads it too, to the same weights, and accelerate() adopts its layers."""
    pytest.importorskip("compressed_tensors")
    model = hfaccel.quantize(tiny_model(arch), "fp8")
    batch = padded_batch()
    expected = dequantized_copy(model).generate(**batch, **GREEDY)
    path = hfaccel.save_quantized(model, tmp_path / "fp8", format="fp8")
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    assert spec["quant_method"] == "compressed-tensors" and spec["format"] == "float-quantized"
    loaded = hfaccel.load_quantized(path, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            assert torch.equal(loaded.get_submodule(name).weight.view(torch.uint8), module.weight.view(torch.uint8))
            assert torch.equal(loaded.get_submodule(name).weight_scale, module.weight_scale)
    assert torch.equal(loaded.generate(**batch, **GREEDY), expected)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(theirs.generate(**batch, **GREEDY), expected)
    # compressed-tensors' own layers (nn.Linear with fp8 weights and a quantization scheme, until a forward
    # decompresses them): accelerate() serves them by Fp8Linear with the same weights and scales; restore() puts
    # the same objects back
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    originals = {name: theirs.get_submodule(name) for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    hfaccel.accelerate(theirs, attention="torch")
    for name, module in originals.items():
        ours = theirs.get_submodule(name)
        assert isinstance(ours, Fp8Linear) and torch.equal(ours.weight_scale, model.get_submodule(name).weight_scale)
    assert torch.equal(theirs.generate(**batch, **GREEDY), expected)
    hfaccel.restore(theirs)
    assert all(theirs.get_submodule(name) is module for name, module in originals.items())


def _block_fp8_checkpoint(path, arch: str, block: int) -> torch.nn.Module:
    """A block-FP8 checkpoint as transformers' FineGrainedFP8 writes one (``weight [N, K]`` e4m3,
    ``weight_scale_inv [ceil(N / b), ceil(K / b)]`` fp32, ``quant_method: fp8``, ``weight_block_size``), made from a
    tiny model; returns the model with those weights dequantized to fp32."""
    model = tiny_model(arch)
    tensors = {}
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and name != "lm_head":
            weight = module.weight.detach()  # [N, K]
            n, k = weight.shape
            padded = torch.nn.functional.pad(weight, (0, -k % block, 0, -n % block))
            blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [N/b, b, K/b, b]
            scale = blocks.abs().amax(dim=(1, 3)) / 448  # [N/b, K/b]
            expanded = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
            quantized = (weight / expanded).to(FP8_DTYPE)
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = quantized, scale
            module.weight.data = quantized.float() * expanded
    tensors.update({k: v.contiguous() for k, v in model.state_dict().items() if k not in tensors})
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (path / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_block_fp8_checkpoint_loads(tmp_path, arch):
    reference = _block_fp8_checkpoint(tmp_path / "block", arch, block=32)
    batch = padded_batch()
    loaded = hfaccel.load_quantized(tmp_path / "block", dtype=torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 14 and {m.granularity for m in layers} == {"blocks of 32x32"}
    assert torch.equal(loaded.generate(**batch, **GREEDY), reference.generate(**batch, **GREEDY))
    hfaccel.accelerate(loaded, attention="triton", compile=False)
    assert torch.equal(loaded.generate(**batch, **GREEDY), reference.generate(**batch, **GREEDY))


def test_fbgemm_fp8_checkpoint_loads(tmp_path):
    """FBGEMM fp8: ``weight`` e4m3 with ``weight_scale [N, 1]`` per channel and an activation bound
    ``input_scale_ub`` (not used: activations stay 16-bit)."""
    model = hfaccel.quantize(tiny_model("llama"), "fp8")
    tensors = {k: v for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            tensors[f"{name}.weight"] = module.weight.t().contiguous()
            tensors[f"{name}.weight_scale"] = module.weight_scale.t().contiguous()
            tensors[f"{name}.input_scale_ub"] = torch.tensor([1200.0])
    (tmp_path / "fbgemm").mkdir()
    save_file(tensors, tmp_path / "fbgemm" / "model.safetensors")
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    (tmp_path / "fbgemm" / "config.json").write_text(json.dumps(config))
    batch = padded_batch()
    loaded = hfaccel.load_quantized(tmp_path / "fbgemm", dtype=torch.float32)
    assert torch.equal(loaded.generate(**batch, **GREEDY), dequantized_copy(model).generate(**batch, **GREEDY))


def test_unread_formats_say_which_are_read(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="reads compressed-tensors fp8 checkpoints"):
        hfaccel.load_quantized(tmp_path)
    config["quantization_config"] = {"quant_method": "bitnet"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fp8 ones"):
        hfaccel.load_quantized(tmp_path)


def test_accelerate_adopts_transformers_fp8_layers_and_restore_puts_them_back():
    """A block-FP8 model as transformers loads it on a GPU (its FineGrainedFP8 ``FP8Linear`` layers; on a CPU it
    dequantizes them, so the test builds them): accelerate() serves them by Fp8Linear with the same weights and
    scales — the dequantized model's tokens — and restore() puts the same layer objects back."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    block = 32
    originals = {}
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and name != "lm_head":
            n, k = module.weight.shape
            layer = FP8Linear(k, n, block_size=(block, block))
            weight = module.weight.detach()
            scale = weight.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(dim=(1, 3)) / 448
            expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            layer.weight.data = (weight / expanded).to(FP8_DTYPE)
            layer.weight_scale_inv.data = scale
            reference.get_submodule(name).weight.data = layer.weight.data.float() * expanded
            replace_module(model, name, layer)
            originals[name] = layer
    batch = padded_batch()
    hfaccel.accelerate(model, attention="torch")
    assert {type(model.get_submodule(name)) for name in originals} == {Fp8Linear}
    assert "14 × fp8 e4m3 blocks of 32x32" in str(model.hfaccel)
    assert torch.equal(model.generate(**batch, **GREEDY), reference.generate(**batch, **GREEDY))
    hfaccel.restore(model)
    assert all(model.get_submodule(name) is layer for name, layer in originals.items())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_accelerate_adopts_fbgemm_fp8_layers_and_restore_puts_them_back(arch):
    """An FBGEMM fp8 model as transformers loads it on a GPU (``FbgemmFp8Linear``: e4m3 ``weight [N, K]``,
    ``weight_scale [N, 1]``; on a CPU transformers dequantizes such checkpoints, so the test builds the layers from a
    per-channel quantization, as the checkpoint test writes them): accelerate() serves them by Fp8Linear — the
    same weights and scales, the dequantized model's tokens — and restore() puts the same layer objects back."""
    from transformers.integrations.fbgemm_fp8 import FbgemmFp8Linear

    quantized = hfaccel.quantize(tiny_model(arch), "fp8")
    reference = dequantized_copy(quantized)
    model, originals = _with_fbgemm_layers(quantized, FbgemmFp8Linear)
    batch, greedy = padded_batch(), dict(GREEDY, max_new_tokens=3)  # the interpreted fp8 kernel: few steps
    expected = reference.generate(**batch, **greedy)
    hfaccel.accelerate(model, attention="torch")
    adopted = [model.get_submodule(name) for name in originals]
    assert {type(layer) for layer in adopted} == {Fp8Linear} and {m.granularity for m in adopted} == {"per channel"}
    assert f"{len(originals)} × fp8 e4m3 per channel" in str(model.hfaccel)
    for name, layer in zip(originals, adopted):  # exact: greedy tiny-model tokens barely move with a scale
        assert torch.equal(layer.dequantized(torch.float32), reference.get_submodule(name).weight), name
    assert torch.equal(model.generate(**batch, **greedy), expected)
    hfaccel.restore(model)
    assert all(model.get_submodule(name) is layer for name, layer in originals.items())


def _with_fbgemm_layers(model: torch.nn.Module, layer_type: type) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """``model`` (its Fp8Linear layers per channel) with each Fp8Linear replaced by transformers' FBGEMM layer holding
    the same weight and scales in FBGEMM's layout; returns it and ``{name: the FBGEMM layer}``."""
    originals = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            layer = layer_type(module.in_features, module.out_features, bias=module.bias is not None)
            layer.weight.data = module.weight.t().contiguous()  # [N, K] e4m3
            layer.weight_scale.data = module.weight_scale.t().contiguous()  # [N, 1]
            layer.input_scale_ub.fill_(1200.0)
            if module.bias is not None:
                layer.bias.data = module.bias.data.float()
            replace_module(model, name, layer)
            originals[name] = layer
    assert originals, "the model holds no Fp8Linear to replace"
    return model, originals


def test_without_fp8_kernels_the_weights_run_dequantized_once(monkeypatch):
    """A GPU where the fp8 kernels do not run (below sm_89; here the CPU, told it is one): attention='triton'
    refuses with the reason before anything changes; otherwise accelerate() serves each fp8 layer by one dense matmul
    of its weight dequantized once (the dequantized model's tokens), with a warning, and says so."""
    import hfaccel.quant.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_kernels_run", lambda device: False)
    monkeypatch.setattr(fp8, "serves_dequantized", lambda device: True)
    model = hfaccel.quantize(tiny_model("llama"), "fp8")
    batch = padded_batch()
    expected = dequantized_copy(model).generate(**batch, **GREEDY)
    with pytest.raises(ValueError, match="sm_89 or later"):
        hfaccel.accelerate(model, attention="triton")
    assert getattr(model, "hfaccel", None) is None
    with pytest.warns(UserWarning, match="no fp8 conversion"):
        hfaccel.accelerate(model, attention="torch")
    layers = fp8.fp8_layers(model)
    assert layers and all(layer.dense is not None and layer.dense.dtype == torch.float32 for layer in layers)
    assert "dequantized to torch.float32 (no fp8 kernel on this device)" in str(model.hfaccel)
    assert torch.equal(model.generate(**batch, **GREEDY), expected)
