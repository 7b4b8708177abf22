"""Where hfaccel depends on PEFT (optional: hfaccel never imports it; a model holding PEFT layers means it is
loaded). Supported: peft 0.18 (the dev extra's floor; 0.17 cannot import under transformers 5) through the newest.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


# ---- PEFT (optional): hfaccel never imports it; a model holding PEFT layers means it is loaded ----
# peft >= 0.18 (the dev extra's floor; tested with 0.18 and 0.21): ``PeftModel`` (``peft_config``, ``active_adapters``,
# ``get_base_model``), adapter layers deriving from ``BaseTunerLayer`` (``active_adapters``, ``disable_adapters``,
# ``merged_adapters``), LoRA layers from ``LoraLayer`` (``lora_A`` / ``lora_B`` module dicts, ``scaling``,
# ``lora_variant`` for DoRA and the other variants), ``modules_to_save`` / trainable tokens from
# ``AuxiliaryTrainingWrapper``.
def _peft():
    """The ``peft`` package when something imported it, else None (then no model can hold PEFT layers)."""
    return sys.modules.get("peft")


def peft_loaded() -> bool:
    """Whether ``peft`` was imported (by anyone): until it is, no model holds PEFT layers."""
    return _peft() is not None


def from_peft(obj) -> bool:
    """Whether ``obj``'s class comes from the ``peft`` package (checked by name: nothing is imported)."""
    return type(obj).__module__.split(".")[0] == "peft"


def is_peft_model(model) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``PeftModelForCausalLM`` and the other task classes)."""
    peft = _peft()
    return peft is not None and isinstance(model, peft.PeftModel)


def peft_base_model(model):
    """The model a ``PeftModel`` wraps, its adapter layers in place: the transformers model for LoRA."""
    return model.get_base_model()


def peft_adapter_types(model) -> dict[str, str]:
    """adapter name -> PEFT method (``"LORA"``, ``"PROMPT_TUNING"``, ...) of every adapter a ``PeftModel`` holds."""
    return {
        name: str(getattr(config.peft_type, "value", config.peft_type)) for name, config in model.peft_config.items()
    }


def peft_active_adapters(model) -> tuple[str, ...]:
    """The adapters a ``PeftModel`` has active (``set_adapter``)."""
    return tuple(model.active_adapters)


def peft_adapters_disabled(model) -> bool:
    """Whether a ``PeftModel`` is inside its ``disable_adapter()`` context."""
    return bool(getattr(model, "_adapters_disabled", False))


def _peft_layer_classes() -> tuple[type, ...]:
    """PEFT's adapter layer base and its wrappers of whole modules (``modules_to_save``, trainable tokens)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import other

    return BaseTunerLayer, other.AuxiliaryTrainingWrapper


def peft_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every PEFT adapter layer and module wrapper in ``model``, in module order (none when peft
    is not loaded). A wrapper's or layer's own submodules are not listed again."""
    if _peft() is None:
        return []
    classes = _peft_layer_classes()
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(outer + ".") for outer, _ in found[-1:]):
            found.append((name, module))
    return found


def peft_layer_modules(model) -> list[torch.nn.Module]:
    """The modules :func:`peft_layers` lists, without their names: a cheaper walk (a PEFT layer's insides are not
    visited), for each ``generate`` call."""
    if _peft() is None:
        return []
    classes = _peft_layer_classes()
    found, stack = [], [model]
    while stack:
        module = stack.pop()
        if isinstance(module, classes):
            found.append(module)
        else:
            stack.extend(reversed(list(module.children())))
    return found


def is_lora_layer(module) -> bool:
    """Whether ``module`` is a PEFT LoRA layer (``peft.tuners.lora.LoraLayer``: Linear, Embedding, Conv...)."""
    if _peft() is None:
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def lora_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) of the PEFT LoRA layers of ``model``, in module order."""
    return [(name, module) for name, module in peft_layers(model) if is_lora_layer(module)]


@dataclass(frozen=True)
class AdapterLayerState:
    """Which adapters one PEFT layer runs: its active adapters, whether adapters are disabled, those merged."""

    active: tuple[str, ...]
    disabled: bool
    merged: tuple[str, ...]


def adapter_layer_state(module) -> AdapterLayerState:
    """The adapter state of a PEFT layer or wrapper."""
    return AdapterLayerState(
        tuple(module.active_adapters),
        bool(module.disable_adapters),
        tuple(getattr(module, "merged_adapters", None) or ()),
    )


def has_forward_pre_hooks(module) -> bool:
    """Whether forward pre-hooks are registered on ``module`` (PEFT registers them on its LoRA layers for the calls
    of a ``generate(adapter_names=...)`` or an aLoRA's ``alora_offsets``)."""
    return bool(module._forward_pre_hooks)


def lora_adapters(layer) -> tuple[str, ...]:
    """The adapters a LoRA layer holds weights of (on a Linear / Conv layer, or on an Embedding)."""
    return tuple(dict.fromkeys([*layer.lora_A.keys(), *layer.lora_embedding_A.keys()]))


def lora_variant(layer, adapter: str) -> str | None:
    """What is not plain LoRA about ``adapter`` on ``layer``: ``"DoRA (use_dora=True)"``, another PEFT variant's
    class name (aLoRA, ...), or None for plain LoRA."""
    variant = layer.lora_variant.get(adapter)
    if variant is not None and "dora" in type(variant).__name__.lower():
        return "DoRA (use_dora=True)"
    return None if variant is None else type(variant).__name__


def lora_weights_key(layer, adapter: str) -> tuple | None:
    """What a static decode step bakes in of ``adapter`` on ``layer`` — its scaling and its weights' storage — or
    None when the layer holds no weights of that adapter."""
    lora_a = layer.lora_A
    if adapter in lora_a:
        weights = (lora_a[adapter].weight, layer.lora_B[adapter].weight)
    elif adapter in layer.lora_embedding_A:
        weights = (layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter])
    else:
        return None
    return adapter, float(layer.scaling[adapter]), *(w.data_ptr() for w in weights)


def lora_linear_parts(layer) -> tuple[torch.nn.Linear, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] | str:
    """A LoRA layer on a plain ``nn.Linear``: ``(base layer, {adapter: (A [r, K], B [N, r], scaling)})`` — the
    weight ``W + scaling * B @ A`` computes what the layer does with those adapters active — or why it is not
    one (another base layer, LoRA on an Embedding, a LoRA bias, weights stored transposed)."""
    base = layer.get_base_layer()
    if type(base) is not torch.nn.Linear:
        return f"its base layer is {type(base).__name__}, not nn.Linear (merge_lora merges LoRA on nn.Linear layers)"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (weights stored transposed)"
    parts = {}
    for adapter in layer.lora_A.keys():
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            return f"adapter {adapter!r} has a LoRA bias (lora_bias=True)"
        parts[adapter] = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, float(layer.scaling[adapter]))
    return base, parts


def peft_wrapped_names(layer) -> list[str]:
    """The names, inside a PEFT layer or wrapper, of the submodules that hold adapter weights or copies: everything
    but a LoRA layer's ``base_layer`` (for a wrapper — ``modules_to_save``, trainable tokens — everything)."""
    return [
        name
        for name, _ in layer.named_modules()
        if name and name != "base_layer" and not name.startswith("base_layer.")
    ]
