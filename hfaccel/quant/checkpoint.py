"""Save and load quantized checkpoints without their quantization libraries: int4 in the AWQ ("gemm") and GPTQ
formats (no gptqmodel/autoawq/optimum), fp8 in the three formats users download — compressed-tensors (``*-FP8``,
``*-FP8-dynamic``: per-channel or per-tensor weight scales ``weight_scale``), block FP8 (transformers'
``FineGrainedFP8Config``, DeepSeek and Qwen3 ``*-FP8``: ``weight_scale_inv`` per 128×128 block) and FBGEMM fp8
(``weight_scale`` per channel).

A checkpoint folder: ``config.json`` with ``quantization_config``, ``*.safetensors`` shards, and (if given)
the tokenizer files. Quantized Linear ``P`` stores ``P.qweight``, ``P.qzeros``, ``P.scales`` (and ``P.g_idx``
for GPTQ) in the format's layout, or (fp8) ``P.weight`` in float8 e4m3 ``[N, K]`` and its scales; everything else
is stored as in a plain transformers checkpoint. fp8 layers are read weight-only (:class:`Fp8Linear`): a
checkpoint's static activation scales (``input_scale``) are not used — activations stay 16-bit. A compressed-tensors
``kv_cache_scheme``'s fp8 KV scales (``*.self_attn.k_scale`` / ``v_scale``, per tensor or per KV head) are kept on
their attention modules as buffers of those names, where an fp8 KV pool finds them (``hfaccel.kv.fp8``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hfaccel.kernels.fp8 import FP8_DTYPE
from hfaccel.quant import formats
from hfaccel.quant.fp8 import Fp8Linear, compressed_tensors_block
from hfaccel.quant.linear import Int4Linear

FORMATS = ("awq", "gptq", "fp8")
FP8_METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8")  # the quant_method of the fp8 formats read


def save_quantized(model: nn.Module, path: str | Path, format: str = "awq", *, tokenizer=None) -> Path:
    """Write ``model`` as a checkpoint folder: with :class:`Int4Linear` layers as AWQ or GPTQ (v1), with
    :class:`Fp8Linear` layers (``format="fp8"``, per-channel or per-tensor scales) as compressed-tensors
    ``float-quantized`` — weights fp8, activations dynamic per token — which transformers (with the
    ``compressed-tensors`` package) and vLLM load."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    if format == "fp8":
        return _save_fp8(model, Path(path), tokenizer)
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
    return _write(model, path, tensors, _quantization_config(format, group_sizes.pop(), quantized.values()), tokenizer)


def _write(model: nn.Module, path: Path, tensors: dict, quantization_config: dict, tokenizer) -> Path:
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _save_fp8(model: nn.Module, path: Path, tokenizer) -> Path:
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if not quantized:
        raise ValueError('the model has no Fp8Linear layers: quantize it first (hfaccel.quantize(model, "fp8"))')
    strategies = {m.granularity for m in quantized.values()}
    if not strategies <= {"per channel", "per tensor"} or len(strategies) != 1:
        raise ValueError(
            f"format='fp8' writes one per-channel or per-tensor scheme; the layers are {sorted(strategies)}"
        )
    path.mkdir(parents=True, exist_ok=True)
    tensors = _plain_tensors(model, quantized)
    for name, module in quantized.items():
        tensors[f"{name}.weight"] = module.weight.t().contiguous().cpu()  # [N, K]
        tensors[f"{name}.weight_scale"] = module.weight_scale.t().contiguous().cpu()  # [N, 1] or [1, 1]
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach().contiguous().cpu()
    strategy = "channel" if strategies == {"per channel"} else "tensor"
    ignore = sorted(name for name, m in model.named_modules() if type(m) is nn.Linear)
    spec = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ignore,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }
    return _write(model, path, tensors, spec, tokenizer)


def _plain_tensors(model: nn.Module, quantized: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    skip = tuple(f"{name}." for name in quantized)
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        tied = {
            name
            for name, p in model.named_parameters(remove_duplicate=False)
            if p is model.get_output_embeddings().weight and not name.startswith("model.")
        }
    state = model.state_dict()
    return {k: v.detach().contiguous().cpu() for k, v in state.items() if not k.startswith(skip) and k not in tied}


def _quantization_config(format: str, group_size: int, modules) -> dict:
    if format == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    modules = list(modules)
    sym = all(bool((m.zeros == 8).all()) for m in modules)
    desc_act = any(m.perm is not None for m in modules)
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
        "true_sequential": True,
    }


def load_quantized(path: str | Path, *, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
    """Load a quantized checkpoint folder into a transformers causal LM: AWQ ("gemm") or GPTQ (v1/v2, sym/asym,
    with or without act-order) with :class:`Int4Linear` layers, or one of the fp8 formats (module docstring) with
    :class:`Fp8Linear` layers. A format it does not read is a ValueError saying which ones it does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    spec = getattr(config, "quantization_config", None)
    if spec is None:
        raise ValueError(f"{path}/config.json has no quantization_config: not a quantized checkpoint")
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    method = spec.get("quant_method")
    block = _fp8_block(spec) if method in FP8_METHODS else None
    if method not in FP8_METHODS:
        _check_int4(method, spec)
    del config.quantization_config
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kv_scales = _kv_scales(state, spec.get("kv_cache_scheme"))
    if method in FP8_METHODS:
        _read_fp8_layers(model, state, block, dtype, device)
    else:
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
    for key, scale in kv_scales.items():  # buffers of their attention modules, where an fp8 KV pool finds them
        owner, _, name = key.rpartition(".")
        model.get_submodule(owner).register_buffer(name, scale.float().to(device))
    model.tie_weights()
    return model.eval()


def _check_int4(method: str | None, spec: dict) -> None:
    bits = spec.get("bits", 4)
    if method not in ("awq", "gptq") or bits != 4:
        raise ValueError(
            f"hfaccel loads 4-bit awq or gptq checkpoints and fp8 ones ({', '.join(FP8_METHODS)}); "
            f"this one is {method!r}" + (f" with {bits} bits" if method in ("awq", "gptq") else "")
        )
    if method == "awq" and spec.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"AWQ version {spec.get('version')!r} is not supported (only 'gemm')")


def _fp8_block(spec: dict) -> tuple[int, int] | None:
    """The weight blocks of an fp8 checkpoint's scales (None: per channel or per tensor, read off the scales'
    shape), or a ValueError for a scheme hfaccel does not read."""
    method = spec["quant_method"]
    if method == "fp8":  # transformers' FineGrainedFP8Config
        block = spec.get("weight_block_size")
        return None if block is None else (int(block[0]), int(block[1]))
    if method == "fbgemm_fp8":
        return None
    schemes = [group.get("weights") or {} for group in (spec.get("config_groups") or {}).values()]
    if spec.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"hfaccel reads compressed-tensors fp8 checkpoints (format float-quantized, 8-bit float "
            f"weights); this one is format {spec.get('format')!r} with weights {schemes}"
        )
    return compressed_tensors_block(schemes)


def _read_fp8_layers(model: nn.Module, state: dict, block: tuple[int, int] | None, dtype: torch.dtype, device) -> None:
    """Replace each Linear layer whose checkpoint weight is fp8 by an :class:`Fp8Linear` of it (its tensors taken
    out of ``state``)."""
    names = sorted(k.rsplit(".", 1)[0] for k, v in state.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE)
    for name in names:
        weight = state.pop(f"{name}.weight")
        scale = state.pop(f"{name}.weight_scale_inv", None)
        scale = state.pop(f"{name}.weight_scale") if scale is None else scale
        for unused in ("input_scale", "input_scale_ub"):  # activation scales: activations stay 16-bit here
            state.pop(f"{name}.{unused}", None)
        bias = state.pop(f"{name}.bias", None)
        _replace(model, name, Fp8Linear.from_checkpoint(weight.to(device), scale.to(device), block, bias, dtype=dtype))


def _kv_scales(state: dict, scheme: dict | None) -> dict[str, torch.Tensor]:
    """A ``kv_cache_scheme``'s ``k_scale`` / ``v_scale`` tensors, taken out of ``state``; a ValueError for a scheme
    other than fp8 (8-bit float, symmetric)."""
    keys = [k for k in state if k.endswith((".k_scale", ".v_scale"))]
    if keys and (
        not scheme or scheme.get("type") != "float" or scheme.get("num_bits") != 8 or not scheme.get("symmetric", True)
    ):
        raise ValueError(
            f"hfaccel reads fp8 KV cache scales (kv_cache_scheme num_bits 8, type float, symmetric); "
            f"this checkpoint has {len(keys)} k_scale/v_scale tensors and kv_cache_scheme {scheme}"
        )
    return {key: state.pop(key) for key in keys}


def _read_weight(state: dict, name: str, method: str, group_size: int, v1: bool) -> formats.Int4Weight:
    qweight, qzeros, scales = (state.pop(f"{name}.{key}") for key in ("qweight", "qzeros", "scales"))
    if method == "awq":
        return formats.from_awq(qweight, qzeros, scales, group_size)
    return formats.from_gptq(qweight, qzeros, scales, state.pop(f"{name}.g_idx", None), group_size, v1=v1)


def _to(weight: formats.Int4Weight, device) -> formats.Int4Weight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return formats.Int4Weight(
        move(weight.qweight),
        move(weight.scales),
        move(weight.zeros),
        weight.group_size,
        move(weight.perm),
        move(weight.g_idx),
    )


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _is_quantized_buffer(model: nn.Module, key: str) -> bool:
    owner = key.rpartition(".")[0]
    return isinstance(model.get_submodule(owner), (Int4Linear, Fp8Linear)) if owner else False
