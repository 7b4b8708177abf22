"""``LoRAManager``: the adapters an engine serves, the slots they occupy, and the model's wrapped layers.

- **Registry.** Adapters registered by name live on the host (:class:`~hfaccel.lora.adapter.LoRAAdapter`, pinned on
  CUDA), checked against the wrapped layers when they are added.
- **Slots.** The device holds ``max_loras`` slots in every wrapped layer. A request's adapter gets a slot when the
  scheduler admits the request (:meth:`acquire`: one reference per running sequence) and keeps it while any running
  sequence uses it; an adapter no running sequence uses stays loaded until its slot is needed for another
  (least recently used first), so a popular adapter is not copied again. Loading copies into the pools in place.
- **Layers.** :func:`lora_layers` picks the Linear layers to wrap: those the given adapters target plus those whose
  names end in ``target_modules`` (by default the attention and MLP projections of Llama-style models), so adapters
  added later find their layers wrapped already. :meth:`close` puts the original layers back.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hfaccel.kv.layout import model_layout
from hfaccel.lora.adapter import LoRAAdapter, load_adapter
from hfaccel.lora.layer import LoRAContext, LoRALinear, layer_device, layer_dtype
from hfaccel.quant import replace_module
from hfaccel.quant.linear import Int4Linear

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_log = logging.getLogger("hfaccel")


class LoRAManager:
    """Serves LoRA adapters over ``model`` (wrapping its layers now): registry, slot pool and wrapped layers.

    Args:
        model: the base model (a transformers causal LM); its target layers are wrapped in place until :meth:`close`.
        adapters: ``{name: PEFT adapter directory}`` to register at once (all checked before the model changes).
        max_loras: slots on the device: the most distinct adapters one step can serve.
        max_rank: the pool's rank; an adapter of a higher rank is refused.
        target_modules: module name endings whose Linear layers are wrapped besides the adapters' own targets.
        backend: the LoRA kernels' backend (``auto``, ``triton``, ``torch``).
    """

    def __init__(
        self,
        model: nn.Module,
        adapters: Mapping[str, str | os.PathLike] | None = None,
        *,
        max_loras: int = 8,
        max_rank: int = 64,
        target_modules: Sequence[str] | None = None,
        backend: str = "auto",
    ):
        if not isinstance(max_loras, int) or isinstance(max_loras, bool) or max_loras < 1:
            raise ValueError(f"max_loras must be an int >= 1; got {max_loras!r}")
        if not isinstance(max_rank, int) or isinstance(max_rank, bool) or max_rank < 1:
            raise ValueError(f"max_lora_rank must be an int >= 1; got {max_rank!r}")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.closed = False
        candidates = linear_layers(model)
        self._shapes = {name: (layer.in_features, layer.out_features) for name, layer in candidates.items()}
        # layers outside the language model (an image-text model's vision tower) are never wrapped: hfaccel runs them
        # without adapters, so an adapter's weights there are kept but unused, and its image requests are refused
        self._language_model = _language_model_prefix(model)
        self._outside = {name for name in candidates if not name.startswith(self._language_model)}
        self._dtype = layer_dtype(next(iter(candidates.values()))) if candidates else torch.float32
        self._pin = any(layer_device(layer).type == "cuda" for layer in candidates.values())
        loaded = [self._load(name, path, self._shapes) for name, path in (adapters or {}).items()]
        targets = set(target_modules if target_modules is not None else DEFAULT_TARGET_MODULES)
        wrap = sorted(
            ({n for n in candidates if n.rsplit(".", 1)[-1] in targets} | {m for a in loaded for m in a.weights})
            - self._outside
        )
        if not wrap:
            raise ValueError(
                f"no Linear layer of {type(model).__name__} ends in any of lora_target_modules="
                f"{sorted(targets)}, and no adapter was given: nothing could take a LoRA adapter"
            )
        # layers another engine wrapped and did not give back (only now: nothing failed); back if this start fails
        self._taken = _take_over(model)
        self.context = LoRAContext(backend)
        self.layers: dict[str, LoRALinear] = {}
        try:
            for name in wrap:
                self.layers[name] = LoRALinear(candidates[name], self.context, max_loras=max_loras, max_rank=max_rank)
                replace_module(model, name, self.layers[name])
        except BaseException:  # out of memory for a pool, say: the model as it was
            self.undo()
            raise
        self.adapters: dict[str, LoRAAdapter] = {}
        for adapter in loaded:
            self.register(adapter)
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._refs: dict[int, int] = {}  # adapter id -> running sequences using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # loaded adapters no sequence uses, least recent first
        self._free = list(range(max_loras - 1, -1, -1))  # pop() gives slot 0 first

    # ------------------------------------------------------------------------------------------- registry
    def load(self, name: str, path: str | os.PathLike) -> LoRAAdapter:
        """The adapter at ``path`` read and checked against the wrapped layers and those outside the language model
        (not registered yet; thread-safe)."""
        return self._load(name, path, {n: self._shapes[n] for n in (*self.layers, *self._outside)})

    def beyond_language_model(self, adapter: LoRAAdapter) -> list[str]:
        """The modules ``adapter`` targets outside the language model (the vision tower's), which hfaccel runs
        without adapters: requests with images cannot take it."""
        return sorted(name for name in adapter.weights if name in self._outside)

    def register(self, adapter: LoRAAdapter) -> None:
        """Serve ``adapter`` under its name (``ValueError`` if the name is taken)."""
        self._check_name_free(adapter.name)
        self.adapters[adapter.name] = adapter

    def _check_name_free(self, name: str) -> None:
        if name in self.adapters:
            raise ValueError(
                f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path}); "
                "remove it first or choose another name"
            )

    def add(self, name: str, path: str | os.PathLike) -> LoRAAdapter:
        """Read, check and register the adapter at ``path`` as ``name``."""
        self._check_name_free(name)  # before reading anything
        adapter = self.load(name, path)
        self.register(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Forget an adapter no running sequence uses (its slot, if loaded, becomes free)."""
        adapter = self.get(name)
        if self._refs.get(adapter.id):
            raise ValueError(f"LoRA adapter {name!r} is used by {self._refs[adapter.id]} running sequences")
        del self.adapters[name]
        if adapter.id in self._slot_of:
            self._idle.pop(adapter.id, None)
            self._free.append(self._slot_of.pop(adapter.id))

    def get(self, name: str) -> LoRAAdapter:
        """The adapter registered as ``name``, or a ``ValueError`` naming those there are."""
        self._check_open()
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(repr(n) for n in sorted(self.adapters)) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {known})")
        return adapter

    def is_registered(self, adapter: LoRAAdapter) -> bool:
        """Whether this very adapter is still served (not removed, nor replaced under its name)."""
        return self.adapters.get(adapter.name) is adapter

    def names(self) -> list[str]:
        return sorted(self.adapters)

    # ---------------------------------------------------------------------------------------------- slots
    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        """Whether a sequence of ``adapter`` can run now: its adapter loaded, or a slot free or idle."""
        return adapter.id in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, adapter: LoRAAdapter) -> int:
        """One more running sequence of ``adapter``; returns its slot (loading it there first if needed)."""
        if adapter.id not in self._slot_of:
            self._slot_of[adapter.id] = self._take_slot()
            self._copy_in(adapter, self._slot_of[adapter.id])
        self._idle.pop(adapter.id, None)
        self._refs[adapter.id] = self._refs.get(adapter.id, 0) + 1
        return self._slot_of[adapter.id]

    def release(self, adapter: LoRAAdapter) -> None:
        """One running sequence of ``adapter`` fewer; with none left it stays loaded but may be evicted."""
        refs = self._refs.get(adapter.id, 0) - 1
        if refs < 0:
            raise AssertionError(f"LoRA adapter {adapter.name!r} released more often than acquired")
        if refs:
            self._refs[adapter.id] = refs
            return
        del self._refs[adapter.id]
        if adapter.id in self._slot_of:
            self._idle[adapter.id] = None

    def slot_of(self, adapter: LoRAAdapter | None) -> int:
        """The slot of a running sequence's adapter (-1: the base model); a RuntimeError once the layers are gone
        (closed, or taken over by another engine), which fails the requests of adapters alone."""
        if adapter is None:
            return -1
        self._check_open()
        return self._slot_of[adapter.id]

    @property
    def num_loaded(self) -> int:
        """Slots holding an adapter."""
        return len(self._slot_of)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._idle:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are in use (check can_acquire first)")
        evicted, _ = self._idle.popitem(last=False)
        return self._slot_of.pop(evicted)

    def _copy_in(self, adapter: LoRAAdapter, slot: int) -> None:
        for name, layer in self.layers.items():
            layer.load_slot(slot, adapter.weights.get(name))

    # -------------------------------------------------------------------------------------------- layers
    def close(self) -> None:
        """Put the model's original layers back (those still in place) and free the pools; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.context.index = None
        for name, layer in self.layers.items():
            if _get(self.model, name) is layer:
                replace_module(self.model, name, layer.base_layer)
        self.layers = {}

    def undo(self) -> None:
        """Take back what making this manager did, for an engine that failed to start: the model's layers back, and
        the layers it took over from another engine back in place (that engine serves its adapters again)."""
        self.close()
        for name, layer in self._taken:
            replace_module(self.model, name, layer)
            layer.context.detached = False
        self._taken = []

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine's LoRA adapters were closed (Engine.close())")
        if self.context.detached:
            raise RuntimeError(
                "another hfaccel Engine made on the same model took over its LoRA layers; this "
                "engine serves the base model only"
            )

    def _load(self, name: str, path, layers: Mapping[str, tuple[int, int]]) -> LoRAAdapter:
        return load_adapter(
            name,
            path,
            layers,
            max_rank=self.max_rank,
            dtype=self._dtype,
            pin_memory=self._pin,
            describe_missing=lambda module: self._why_not(module),
        )

    def _why_not(self, module: str) -> str:
        """Why ``module`` is not among the layers an adapter can target."""
        try:
            found = _get(self.model, module)
        except AttributeError:
            return f"the base model ({type(self.model).__name__}) has no module of that name"
        if module in self._shapes:  # a Linear layer of the base, not wrapped
            return (
                "this engine did not wrap it for LoRA; make the engine with lora_target_modules including "
                f"{module.rsplit('.', 1)[-1]!r}"
            )
        if module in _output_layers(self.model):
            return "it is the output embedding (lm_head), which LoRA adapters cannot target here"
        if module in _latent_expanders(self.model):
            return (
                "it expands a multi-head latent attention layer's cached latents, every token each sequence holds, "
                "in batches whose sequences take different adapters: LoRA on it is not served by the engine"
            )
        grouped = _grouped_layers(self.model).get(module)
        if grouped is not None:
            return (
                f"it is a layer of {grouped}, which hfaccel runs per group of sequences: LoRA on it is not served by "
                "the engine"
            )
        return f"it is a {type(found).__name__}, not a Linear layer"


def _latent_expanders(model: nn.Module) -> set[str]:
    """The layers through which multi-head latent attention modules expand the latents they read from the cache
    (transformers' ``expand_kv``: ``kv_b_proj``)."""
    return {
        f"{name}.kv_b_proj" for name, module in model.named_modules() if callable(getattr(module, "expand_kv", None))
    }


def _grouped_layers(model: nn.Module) -> dict[str, str]:
    """The layers of the modules hfaccel runs per group of sequences, apart from the packed rows a LoRA index follows
    (sparse-attention indexers: ``hfaccel.kv.indexer``), each with what it belongs to. (Recurrent layers' mixers,
    also run per group, tell the LoRA context which packed token each of their rows is: ``hfaccel.kv.state``.)"""
    layout = model_layout(model)
    owners = {f"{name}.": "a sparse-attention indexer" for name in layout.indexers.values()}
    if not owners:
        return {}
    prefixes = tuple(owners)
    return {
        name: next(owners[prefix] for prefix in prefixes if name.startswith(prefix))
        for name, _ in model.named_modules()
        if name.startswith(prefixes)
    }


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers a LoRA adapter may target: every ``nn.Linear`` (not a subclass: quantized layers of other
    libraries) and ``Int4Linear`` but the output embedding, MLA's latent expansions and the sparse-attention
    indexers' layers (run per group of sequences), by module name — for a layer another engine wrapped already, the
    layer it wraps."""
    skip, found, wrapped = _output_layers(model) | _latent_expanders(model) | set(_grouped_layers(model)), {}, ()
    for name, m in model.named_modules():  # parents come before their children
        if name.startswith(wrapped):
            continue
        if isinstance(m, LoRALinear):
            found[name] = m.base_layer
            wrapped += (name + ".",)
        elif (type(m) is nn.Linear or isinstance(m, Int4Linear)) and name not in skip:
            found[name] = m
    return found


def _language_model_prefix(model: nn.Module) -> str:
    """The module-name prefix of ``model``'s language model (``transformers``' ``get_decoder()``: ``"model."`` for a
    causal LM, ``"model.language_model."`` for most image-text models); ``""`` where it has none of its own."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    name = next((name for name, m in model.named_modules() if m is decoder), "")
    return f"{name}." if name else ""


def _output_layers(model: nn.Module) -> set[str]:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name for name, m in model.named_modules() if output is not None and m is output}


def _take_over(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """Unwrap layers another manager left wrapped (an engine not closed yet): its engine then serves the base only.
    Returns the layers taken out, by name."""
    left = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not left:
        return left
    _log.warning(
        "hfaccel: %d LoRA layers of another Engine on this model are given back to the model first (call "
        "engine.close() on an engine you are done with)",
        len(left),
    )
    for name, layer in left:
        layer.context.detached = True
        layer.context.index = None
        replace_module(model, name, layer.base_layer)
    return left


def _get(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)
