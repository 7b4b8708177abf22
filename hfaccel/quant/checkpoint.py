"""Save and load int4 checkpoints in the AWQ ("gemm") and GPTQ formats, without gptqmodel/autoawq/optimum.

A checkpoint folder: ``config.json`` with ``quantization_config``, ``*.safetensors`` shards, and (if given)
the tokenizer files. Quantized Linear ``P`` stores ``P.qweight``, ``P.qzeros``, ``P.scales`` (and ``P.g_idx``
for GPTQ) in the format's layout; everything else is stored as in a plain transformers checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hfaccel.quant import formats
from hfaccel.quant.linear import Int4Linear

FORMATS = ("awq", "gptq")


def save_quantized(model: nn.Module, path: str | Path, format: str = "awq", *, tokenizer=None) -> Path:
    """Write ``model`` (with :class:`Int4Linear` layers) as an AWQ or GPTQ (v1) checkpoint folder."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    if not quantized:
        raise ValueError("the model has no Int4Linear layers: quantize it first (hfaccel.quantize)")
    group_sizes = {m.group_size for m in quantized.values()}
    if len(group_sizes) != 1:
        raise ValueError(f"one group size per checkpoint; the model mixes {sorted(group_sizes)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _plain_tensors(model, quantized)
    for name, module in quantized.items():
        weight = module.int4_weight()
        packed = formats.to_awq(weight) if format == "awq" else formats.to_gptq(weight, v1=True)
        tensors.update({f"{name}.{key}": value.contiguous().cpu() for key, value in packed.items()})
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().contiguous().cpu()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = _quantization_config(format, group_sizes.pop(), quantized.values())
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _plain_tensors(model: nn.Module, quantized: dict[str, Int4Linear]) -> dict[str, torch.Tensor]:
    skip = tuple(f"{name}." for name in quantized)
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        tied = {name for name, p in model.named_parameters(remove_duplicate=False)
                if p is model.get_output_embeddings().weight and not name.startswith("model.")}
    state = model.state_dict()
    return {k: v.detach().contiguous().cpu() for k, v in state.items() if not k.startswith(skip) and k not in tied}


def _quantization_config(format: str, group_size: int, modules) -> dict:
    if format == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    modules = list(modules)
    sym = all(bool((m.zeros == 8).all()) for m in modules)
    desc_act = any(m.perm is not None for m in modules)
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "true_sequential": True}


def load_quantized(path: str | Path, *, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
    """Load an AWQ ("gemm") or GPTQ (v1/v2, sym/asym, with or without act-order) checkpoint folder into a
    transformers causal LM whose quantized Linear layers are :class:`Int4Linear`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    spec = getattr(config, "quantization_config", None)
    if spec is None:
        raise ValueError(f"{path}/config.json has no quantization_config: not an AWQ/GPTQ checkpoint")
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    method, bits = spec.get("quant_method"), spec.get("bits", 4)
    if method not in FORMATS or bits != 4:
        raise ValueError(f"hfaccel loads 4-bit awq or gptq checkpoints; this one is {method!r} with {bits} bits")
    if method == "awq" and spec.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"AWQ version {spec.get('version')!r} is not supported (only 'gemm')")
    del config.quantization_config
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    v1 = spec.get("checkpoint_format", "gptq") != "gptq_v2"
    for name in sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".qweight")}):
        weight = _read_weight(state, name, method, spec["group_size"], v1)
        bias = state.pop(f"{name}.bias", None)
        _replace(model, name, Int4Linear.from_weight(_to(weight, device), bias, dtype=dtype))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied and not _is_quantized_buffer(model, k)]
    if unexpected or missing:
        raise ValueError(f"checkpoint does not match the model: unexpected {unexpected[:5]}, missing {missing[:5]}")
    model.tie_weights()
    return model.eval()


def _read_weight(state: dict, name: str, method: str, group_size: int, v1: bool) -> formats.Int4Weight:
    qweight, qzeros, scales = (state.pop(f"{name}.{key}") for key in ("qweight", "qzeros", "scales"))
    if method == "awq":
        return formats.from_awq(qweight, qzeros, scales, group_size)
    return formats.from_gptq(qweight, qzeros, scales, state.pop(f"{name}.g_idx", None), group_size, v1=v1)


def _to(weight: formats.Int4Weight, device) -> formats.Int4Weight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return formats.Int4Weight(move(weight.qweight), move(weight.scales), move(weight.zeros), weight.group_size,
                              move(weight.perm), move(weight.g_idx))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _is_quantized_buffer(model: nn.Module, key: str) -> bool:
    owner = key.rpartition(".")[0]
    return isinstance(model.get_submodule(owner), Int4Linear) if owner else False
