"""PEFT LoRA models under ``accelerate``: the LoRA layers of an accelerated model, kept unmerged (the decode steps
keyed on which adapters they run) or merged into new Linear layers that ``restore`` takes out again.

Unmerged, a LoRA layer is a module of the model like any other: hfaccel's decode loop runs the model's forward,
and PEFT's layer adds ``scaling * B(A(x))`` to its base layer's output on the packed tokens. What a static decode
step bakes in is which adapters run — a compiled step specialises on the layers' Python branches, a captured CUDA
graph on the weights' addresses — so every ``generate`` call reads the layers' adapter state (active adapters,
disabled, merged, the active weights' storage and scaling: :meth:`LoraState.call_state`) and the model's decode
session keeps one set of steps per state (``DecodeSession.adapters``). PEFT's own API (``set_adapter``,
``disable_adapter()``, ``load_adapter``, ``merge_adapter``) keeps working between calls.

Nothing here imports ``peft``: every PEFT detail is in ``hfaccel.compat``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import nn

from hfaccel import compat
from hfaccel.quant import replace_module

# why a call whose LoRA layers carry PEFT's per-call forward hooks runs transformers' loop: the hooks pass each row's
# adapter (``generate(adapter_names=...)``) or an aLoRA's offsets, which hfaccel's packed forwards cannot take
HOOKED = "PEFT forward hooks on the LoRA layers (adapter_names / alora_offsets)"


def check_peft_model(model) -> None:
    """Raise unless ``model``, a ``PeftModel``, holds LoRA adapters only (prompt tuning, IA3, LoHa... are not)."""
    kinds = compat.peft_adapter_types(model)
    other = {name: kind for name, kind in kinds.items() if kind != "LORA"}
    if other:
        raise ValueError(
            f"hfaccel.accelerate serves PEFT models with LoRA adapters (peft_type LORA); "
            f"{type(model).__name__} holds {other}"
        )


@dataclass
class LoraState:
    """The PEFT LoRA layers of an accelerated model (``model.hfaccel.lora``): ``model`` is the transformers model
    holding them, ``owner`` the ``PeftModel`` accelerate was given (None when given the transformers model)."""

    model: nn.Module
    owner: nn.Module | None = None
    merged: list[tuple[str, nn.Module]] = field(default_factory=list)  # (name, LoRA layer) replaced by hfaccel
    merged_adapters: tuple[str, ...] = ()  # the adapters merged into those Linear layers

    # ------------------------------------------------------------------------------------------- each call
    def call_state(self) -> tuple[Hashable, str | None]:
        """``(key, reason)`` for one ``generate`` call: ``key`` names what the model's adapter layers run now (equal
        keys: the same decode steps serve; None: the model holds no PEFT layer); ``reason`` is why transformers' loop
        must serve the call, or None.
        Raises ``ValueError`` for an active adapter hfaccel does not serve and for adapters switched under
        ``merge_lora=True``."""
        if self.merged:
            self._check_merged_adapters()
        parts: list = [("merged by hfaccel", self.merged_adapters)] if self.merged else []
        hooked = False
        for module in compat.peft_layer_modules(self.model):
            state = compat.adapter_layer_state(module)
            parts.append((id(module), state))
            if not compat.is_lora_layer(module):
                continue
            hooked = hooked or compat.has_forward_pre_hooks(module)
            if state.disabled or state.merged:
                continue
            for adapter in state.active:
                key = compat.lora_weights_key(module, adapter)
                if key is not None:  # the layer holds this adapter
                    _check_plain(module, adapter, self.model)
                    parts.append(key)
        return (tuple(parts) if parts else None), (HOOKED if hooked else None)

    def _check_merged_adapters(self) -> None:
        """Under ``merge_lora=True`` the adapters are fixed: a PeftModel switched or disabled since is an error."""
        if self.owner is None:
            return
        active = compat.peft_active_adapters(self.owner)
        if compat.peft_adapters_disabled(self.owner) or active != self.merged_adapters:
            state = "adapters disabled" if compat.peft_adapters_disabled(self.owner) else f"active adapters {active}"
            raise ValueError(
                f"hfaccel.accelerate(merge_lora=True) merged adapters {self.merged_adapters} into the "
                f"model's weights; the PeftModel now has {state}. Call hfaccel.restore(model) before "
                f"switching or disabling adapters (then accelerate again), or accelerate without "
                f"merge_lora to switch them freely"
            )

    # --------------------------------------------------------------------------------------------- merge
    def merge(self) -> None:
        """Replace every LoRA layer by a new ``nn.Linear`` holding ``W + scaling * B @ A`` of its active adapters
        (computed in fp32, cast to ``W``'s dtype; the bias shared); the LoRA layers are kept for :meth:`unmerge`.
        :func:`check_mergeable` has checked every layer first."""
        layers = compat.lora_layers(self.model)
        self.merged_adapters = _active_adapters(layers)
        for name, layer in layers:
            replace_module(self.model, name, merged_linear(layer))
            self.merged.append((name, layer))

    def unmerge(self) -> None:
        """Put the LoRA layers :meth:`merge` replaced back (their weights were never touched)."""
        for name, layer in reversed(self.merged):
            replace_module(self.model, name, layer)
        self.merged.clear()

    # ---------------------------------------------------------------------------------------- quantization
    def quantize_skip(self, skip: tuple[str, ...] = ("lm_head",)) -> tuple[str, ...]:
        """``skip`` for ``hfaccel.quantize`` that quantizes the base layers (each LoRA layer's ``base_layer``) and
        never the adapters' own layers (``lora_A`` / ``lora_B``), ``modules_to_save`` copies nor trainable tokens;
        a LoRA layer on a skipped name (``lm_head``) keeps its base layer too."""
        names = list(skip)
        for name, layer in compat.peft_layers(self.model):
            names += [f"{name}.{inner}" for inner in compat.peft_wrapped_names(layer)]
            if any(name == s or name.endswith("." + s) for s in skip):
                names.append(f"{name}.base_layer")
        return tuple(names)

    def __str__(self) -> str:
        if self.merged:
            return (
                f"LoRA: {len(self.merged)} layers, {_adapter_names(self.merged_adapters)} merged into the "
                f"weights by hfaccel (restore() unmerges)"
            )
        layers = compat.lora_layers(self.model)
        states = [compat.adapter_layer_state(layer) for _, layer in layers]
        if not states:
            return "LoRA: no layers left"
        if any(state.disabled for state in states):
            how = "adapters disabled"
        else:
            how = f"{_adapter_names(states[0].active)}, {'merged by PEFT' if states[0].merged else 'unmerged'}"
        return f"LoRA: {len(layers)} layers, {how}"


def prepare_lora(model, target: nn.Module, *, merge_lora: bool, quantize: str | None) -> LoraState | None:
    """Check what ``accelerate`` is asked to do with ``target``'s LoRA layers (``model``: what accelerate was given,
    a ``PeftModel`` or ``target`` itself); raises ``ValueError`` before anything changes. None without LoRA
    layers."""
    layers = compat.lora_layers(target)
    if not layers:
        if merge_lora:
            raise ValueError(
                f"merge_lora=True merges the LoRA adapters of a PEFT model (a peft PeftModel, e.g. from "
                f"PeftModel.from_pretrained); {type(model).__name__} has no LoRA layers"
            )
        return None
    for _, layer in layers:
        for adapter in compat.adapter_layer_state(layer).active:
            if adapter in compat.lora_adapters(layer):
                _check_plain(layer, adapter, target)
    if merge_lora:
        check_mergeable(layers)
    elif quantize is not None and quantize != "rtn":
        raise ValueError(
            f"quantize={quantize!r} calibrates the base layers for their inputs, which unmerged LoRA "
            f"adapters change; with unmerged LoRA layers use quantize='rtn', or merge_lora=True"
        )
    if quantize is not None and compat.tp_size(target) > 1:
        raise ValueError("quantize under tensor parallelism is not supported for a model with LoRA layers")
    return LoraState(target, owner=model if model is not target else None)


def check_mergeable(layers: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` naming the first LoRA layer ``merge_lora=True`` cannot merge."""
    active = _active_adapters(layers)
    for name, layer in layers:
        state = compat.adapter_layer_state(layer)
        if state.disabled:
            raise ValueError(f"merge_lora=True merges the active adapters; the adapters of {name!r} are disabled")
        if state.merged:
            raise ValueError(
                f"merge_lora=True: {name!r} already has adapters {state.merged} merged by PEFT "
                f"(merge_adapter()); unmerge_adapter() first, or accelerate without merge_lora"
            )
        if state.active != active:
            raise ValueError(
                f"merge_lora=True merges one set of active adapters; {name!r} has {state.active}, other layers {active}"
            )
        parts = compat.lora_linear_parts(layer)
        if isinstance(parts, str):
            raise ValueError(
                f"merge_lora=True cannot merge {name!r}: {parts}; accelerate without merge_lora "
                f"(the LoRA layers then run unmerged)"
            )


def merged_linear(layer: nn.Module) -> nn.Linear:
    """A new ``nn.Linear`` computing what the LoRA ``layer`` computes with its active adapters: ``W + scaling * B @ A``
    in fp32, cast to ``W``'s dtype; the base layer's bias is shared, nothing of ``layer`` changes."""
    base, parts = compat.lora_linear_parts(layer)
    weight = base.weight.detach().float()
    for adapter in compat.adapter_layer_state(layer).active:
        if adapter in parts:
            a, b, scaling = parts[adapter]
            weight = weight + (b.detach().float() @ a.detach().float()) * scaling
    linear = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.to(base.weight.dtype), requires_grad=False)
    linear.bias = base.bias
    return linear


def _check_plain(layer: nn.Module, adapter: str, model: nn.Module) -> None:
    """Raise ``ValueError`` when the active ``adapter`` of ``layer`` (in ``model``) is not plain LoRA (DoRA,
    aLoRA...)."""
    variant = compat.lora_variant(layer, adapter)
    if variant is not None:
        name = next((name for name, module in model.named_modules() if module is layer), "?")
        raise ValueError(
            f"hfaccel serves plain LoRA adapters; adapter {adapter!r} on {name!r} is {variant}. Merge it "
            f"into the base model with PEFT first (model = peft_model.merge_and_unload()) and accelerate "
            f"that"
        )


def _active_adapters(layers: list[tuple[str, nn.Module]]) -> tuple[str, ...]:
    return compat.adapter_layer_state(layers[0][1]).active if layers else ()


def _adapter_names(names: tuple[str, ...]) -> str:
    return ("adapter " if len(names) == 1 else "adapters ") + ", ".join(repr(n) for n in names)
