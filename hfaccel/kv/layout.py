"""What each layer of a model keeps while it generates: K/V of some width, recurrent state, or nothing.

Read off transformers' own cache after one forward of one token (:func:`probe_layout`), so that every family is
described by its own modeling code rather than by config fields that differ between families (Gemma 4's per-layer
head sizes, MLA's key and value widths, hybrid models' convolution and SSM states, layers that share another
layer's K/V). The forward also records which module reads and writes each recurrent layer's state (its *mixer*),
the module hfaccel later runs per sequence (``hfaccel.kv.state``), and which module stores each sparse-attention
layer's indexer keys (its *indexer*, run per group of sequences too: ``hfaccel.kv.indexer``).
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

from hfaccel import compat
from hfaccel.device import model_device, per_model
from hfaccel.kv.continuation import chunk_restarting_layers

# the Cache methods through which a mixer reaches its layer's recurrent state (transformers 5.17 and 5.24; MiniMax's
# own cache: its linear attention's state)
STATE_METHODS = (
    "get_conv_state",
    "get_recurrent_state",
    "update_conv_state",
    "update_recurrent_state",
    "has_previous_state",
    "get_linear_cache",
    "set_linear_cache",
)


@dataclass(frozen=True)
class AttentionKV:
    """One layer's K/V: ``kv_heads`` heads of keys ``key_dim`` wide and values ``value_dim`` wide; ``window``: the
    sliding window its queries attend within, ``chunk``: the attention chunk (Llama 4's ``attention_chunk_size``)
    they attend within (None: every earlier key), as transformers' cache and masks hold them. ``expanded_dim``: where
    what the layer caches is a latent its attention module expands after reading the cache (multi-head latent
    attention, MLA: ``expand_kv`` of its compressed K/V, 1 head ``kv_lora_rank`` wide, and its shared rotary key), the
    widest head of the K/V its attention then reads; the cache returns the latents themselves, not a view the
    attention reads."""

    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None
    chunk: int | None = None
    expanded_dim: int | None = None
    indexer_dim: int = 0

    @property
    def width(self) -> int:
        """The head width the pool stores keys and values in: the narrower of the two zero-padded to the wider; a
        latent layer's two latents (and its indexer key) one after the other, split in halves between the key and
        value rows (:func:`split_latents`)."""
        if self.latent:
            return -(-(self.key_dim + self.value_dim + self.indexer_dim) // 2)
        return max(self.key_dim, self.value_dim)

    @property
    def latent(self) -> bool:
        return self.expanded_dim is not None

    @property
    def read_width(self) -> int:
        """The head width of the K/V the layer's attention reads (the kernels' head dim)."""
        return self.expanded_dim or self.width


@dataclass(frozen=True)
class StateShape:
    """One tensor of a layer's recurrent state, per sequence: its shape without the batch dimension, its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class RecurrentState:
    """One layer's recurrent state: per state index, its convolution state (``conv``) and its recurrent (SSM,
    delta-rule) state, each None where the layer keeps none; ``conv_kernel_size`` per state index."""

    conv: tuple[StateShape | None, ...]
    recurrent: tuple[StateShape | None, ...]
    conv_kernel_size: tuple[int | None, ...]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.conv + self.recurrent if s is not None)


@dataclass(frozen=True)
class ModelLayout:
    """What each cache layer of a model keeps (module docstring)."""

    num_layers: int  # layers of transformers' cache (what the model indexes its cache with)
    attention: dict[int, AttentionKV] = field(default_factory=dict)  # layers that write K/V
    states: dict[int, RecurrentState] = field(default_factory=dict)  # layers with recurrent state
    mixers: dict[int, str] = field(default_factory=dict)  # state layer -> name of the module that runs it
    # sparse-attention layer -> name of its indexer module (the one storing indexer keys: hfaccel.kv.indexer)
    indexers: dict[int, str] = field(default_factory=dict)
    # state layers whose mixer starts a chunk of several tokens from an empty state, reading its state only one token
    # at a time (transformers' Mamba-1 mixers): hfaccel runs their continuing chunks token by token
    restarts_chunks: frozenset[int] = frozenset()

    @property
    def hybrid(self) -> bool:
        """Whether some layer keeps recurrent state (a hybrid or recurrent model)."""
        return bool(self.states)

    def state_bytes(self) -> int:
        """Bytes of every layer's recurrent state of one sequence."""
        return sum(state.bytes for state in self.states.values())

    def describe(self) -> str:
        """One line: how many layers keep K/V (and of which widths), how many keep state."""
        widths = sorted(
            {(kv.latent, kv.kv_heads, kv.key_dim, kv.value_dim, kv.indexer_dim) for kv in self.attention.values()}
        )
        shapes = ", ".join(
            ("latent: " if latent else "")
            + f"{h} heads x {k}"
            + (f"/{v}" if v != k else "")
            + (f", indexer keys x {i}" if i else "")
            for latent, h, k, v, i in widths
        )
        if not self.attention:  # a recurrent-only model (Mamba)
            return f"no layer keeps K/V, {len(self.states)} of {self.num_layers} keep recurrent state"
        text = f"{len(self.attention)} of {self.num_layers} layers keep K/V ({shapes})"
        return text + (f", {len(self.states)} keep recurrent state" if self.states else "")


def widened(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor [..., D]`` zero-padded to ``[..., width]`` (itself where ``D == width``); a ``ValueError`` where it is
    wider."""
    extra = width - tensor.shape[-1]
    if extra < 0:
        raise ValueError(f"a head {tensor.shape[-1]} wide cannot be held {width} wide")
    return tensor if extra == 0 else torch.nn.functional.pad(tensor, (0, extra))


def split_latents(keys: torch.Tensor, values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent layer's latents ``[..., key_dim]`` and ``[..., value_dim]`` (the value latent followed by the
    layer's indexer key, where it has one) as the pool's key and value rows ``[..., width]``: one after the other,
    zero-padded to ``2 * width``, in halves."""
    joined = widened(torch.cat([keys, values], dim=-1), 2 * width)
    return joined[..., :width], joined[..., width:]


def joined_latents(keys: torch.Tensor, values: torch.Tensor, kv: AttentionKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's two latents ``[..., key_dim]`` and ``[..., value_dim]`` from what :func:`split_latents` stored (or
    from the latents themselves: their concatenation is the same)."""
    joined = torch.cat([keys, values], dim=-1)
    return joined[..., : kv.key_dim], joined[..., kv.key_dim : kv.key_dim + kv.value_dim]


def indexer_columns(kv: AttentionKV) -> slice:
    """The columns of a sparse-attention layer's value rows that hold its indexer keys (:func:`split_latents`: after
    both latents, which are wider than them, so all in the second half)."""
    start = kv.key_dim + kv.value_dim - kv.width
    return slice(start, start + kv.indexer_dim)


def uniform_layout(num_layers: int, kv_heads: int, head_dim: int) -> ModelLayout:
    """Every layer keeping K/V of one shape (a classic decoder; what a config alone describes)."""
    return ModelLayout(num_layers, {i: AttentionKV(kv_heads, head_dim, head_dim) for i in range(num_layers)})


def kv_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model config (its text config for composite models)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def kv_heads_per_layer(config) -> list[int]:
    """Each layer's KV heads by a model config (one entry where every layer has the same: most configs say one
    number; Gemma 4's says each layer's, its global layers having fewer)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text, "is_heterogeneous", False):  # (every config has a per-layer view; most one of one layer)
        return [kv_dims(config)[1]]
    return [getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads for layer in text.per_layer_config]


def local_kv_heads(model) -> int:
    """The KV heads this process holds of each layer (of its first where they differ): the config's, or on a
    tensor-parallel rank (a model transformers loaded with ``tp_plan``) its share, ``num_key_value_heads /
    tp_size``. A ``ValueError`` when the TP size does not divide every layer's KV heads (no rank can hold whole
    heads)."""
    heads = kv_heads_per_layer(model.config)
    size = compat.tp_size(model)
    if size == 1 or not compat.tp_splits_kv_heads(model):
        return heads[0]
    uneven = sorted({count for count in heads if count % size})
    if uneven:
        which = (
            "the model's KV heads"
            if len(set(heads)) == 1
            else f"every layer's KV heads (layers have {sorted(set(heads))})"
        )
        raise ValueError(
            f"hfaccel needs the tensor-parallel size to divide {which}, so that each rank holds whole heads: "
            f"num_key_value_heads={uneven[0]}, tp_size={size} (use a tp_size that divides {uneven[0]})"
        )
    return heads[0] // size


class LayoutError(ValueError):
    """A model whose cache hfaccel's pool cannot hold; the message says why."""


_log = logging.getLogger("hfaccel")
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ((dtype, device), layout)


def model_layout(model) -> ModelLayout:
    """The layout of ``model`` (:func:`probe_layout`), probed once per model, dtype and device."""
    return per_model(_LAYOUTS, model, probe_layout)


def own_cache_class(model) -> type[DynamicCache] | None:
    """The ``DynamicCache`` subclass that ``model``'s modeling module defines for itself and its forward insists on
    (MiniMax's ``MiniMaxCache``, which keeps its linear attention's state in ``linear_cache``), or None."""
    module = sys.modules.get(type(model).__module__)
    own = (
        [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, DynamicCache) and value.__module__ == module.__name__
        ]
        if module is not None
        else []
    )
    return own[0] if len(own) == 1 else None


def probe_layout(model) -> ModelLayout:
    """Run ``model`` on one token over transformers' own ``DynamicCache`` (or the model's own subclass of it) and read
    what each layer stored; a ``LayoutError`` (or the model's own error) where it does not run so or stores something
    else."""
    own = own_cache_class(model)
    cache = DynamicCache(config=model.config) if own is None else own()
    mixers: dict[int, str] = {}
    indexers: dict[int, str] = {}
    token = torch.ones(1, 1, dtype=torch.long, device=model_device(model))
    recorded = {**dict.fromkeys(STATE_METHODS, mixers), "update_indexer": indexers}
    with ExitStack() as stack, torch.inference_mode():
        _record_callers(model, cache, recorded, stack)
        model(input_ids=token, use_cache=True, **{compat.cache_argument(model): cache})
    for method in recorded:  # the cache's own methods again
        vars(cache).pop(method, None)
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    layout = _read_layout(cache, mixers, tuple(layer_types), _latent_layers(model))
    with torch.inference_mode():
        restarts = chunk_restarting_layers(model, cache, {layer: layout.mixers[layer] for layer in layout.states})
    return replace(layout, indexers={layer: indexers[layer] for layer in sorted(indexers)}, restarts_chunks=restarts)


def _latent_layers(model) -> dict[int, int]:
    """The layers whose attention module expands what it caches after reading it (transformers' MLA modules:
    ``expand_kv``), each with the widest head it expands to."""
    return {
        module.layer_idx: max(module.qk_head_dim, module.v_head_dim)
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and callable(getattr(module, "expand_kv", None))
    }


def _record_callers(model, cache: DynamicCache, records: dict[str, dict[int, str]], stack: ExitStack) -> None:
    """While ``stack`` is open, note in ``records[method]`` the innermost module (with a ``layer_idx``) running when
    each layer's cache method of that name is called (the recurrent layers' state methods: their mixers; a sparse
    attention layer's ``update_indexer``: its indexer): the probe's own cache gets recording methods, the modules
    hooks that keep a stack of the running ones."""
    running: list[tuple[int, str]] = []

    def leave(*_) -> None:
        running.pop()

    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            stack.enter_context(
                module.register_forward_pre_hook(lambda _m, _a, entry=(index, name): running.append(entry))
            )
            stack.enter_context(module.register_forward_hook(leave, always_call=True))
    for method, callers in records.items():
        if hasattr(cache, method):
            setattr(cache, method, _recording(getattr(cache, method), running, callers))


def _recording(method: Callable, running: list[tuple[int, str]], mixers: dict[int, str]) -> Callable:
    signature = inspect.signature(method)

    def record(*args, **kwargs):
        layer = signature.bind(*args, **kwargs).arguments.get("layer_idx")
        owner = next((name for index, name in reversed(running) if index == layer), None)
        if layer is not None and owner is not None:
            mixers.setdefault(layer, owner)
        return method(*args, **kwargs)

    return record


def _read_layout(
    cache: DynamicCache, mixers: dict[int, str], layer_types: tuple[str, ...], latent: dict[int, int]
) -> ModelLayout:
    attention: dict[int, AttentionKV] = {}
    states: dict[int, RecurrentState] = {}
    for index, state in enumerate(getattr(cache, "linear_cache", ())):  # MiniMax's own cache: [B, H, D, D] each
        if isinstance(state, torch.Tensor):
            states[index] = RecurrentState((None,), (StateShape(tuple(state.shape[1:]), state.dtype),), (None,))
    for index, layer in enumerate(cache.layers):
        known = False
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states[index] = _state(index, layer)
            known = True
        if isinstance(layer, CacheLayerMixin):
            if (own := _own_state(layer)) is not None:
                raise LayoutError(
                    f"layer {index} keeps state of its own beside its K/V ({type(layer).__name__}: {own}), which "
                    "hfaccel's pool does not hold"
                )
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            # latents are one head; a module that expands before caching (DeepSeek-V3.2 on transformers 5.17) caches K/V
            expanded_dim = latent.get(index) if isinstance(keys, torch.Tensor) and keys.shape[1] == 1 else None
            indexer_keys = getattr(layer, "indexer_keys", None)  # [B, S, D]: DeepSeek Sparse Attention's
            if not isinstance(indexer_keys, torch.Tensor) or not indexer_keys.numel():
                indexer_keys = None  # none written: a layer that reuses another layer's choice of keys
            if indexer_keys is not None and expanded_dim is None:
                raise LayoutError(
                    f"layer {index} keeps indexer keys beside K/V that are not latents (sparse attention with an "
                    "indexer over full keys), which hfaccel's pool does not hold"
                )
            if indexer_keys is not None and indexer_keys.shape[-1] > keys.shape[-1] + values.shape[-1]:
                raise LayoutError(
                    f"layer {index}'s indexer keys ({indexer_keys.shape[-1]} wide) are wider than its latents, which "
                    "hfaccel's pool does not hold"
                )
            window = layer.sliding_window if getattr(layer, "is_sliding", False) else None
            # transformers' cache keeps a chunked layer as a sliding one of the chunk's size; only its mask differs
            chunked = index < len(layer_types) and layer_types[index] == "chunked_attention"
            if isinstance(keys, torch.Tensor) and keys.numel():
                attention[index] = AttentionKV(
                    keys.shape[1],
                    keys.shape[-1],
                    values.shape[-1],
                    None if chunked else window,
                    window if chunked else None,
                    expanded_dim,
                    0 if indexer_keys is None else indexer_keys.shape[-1],
                )
            known = True
        if not known and type(layer).__name__ != "DummyLayer":
            raise LayoutError(f"cache layer {index} is a {type(layer).__name__}, which hfaccel's pool does not hold")
    missing = sorted(set(states) - set(mixers))
    if missing:
        raise LayoutError(f"no module was seen reading the recurrent state of layers {missing}")
    num_layers = max(len(cache.layers), max(states, default=-1) + 1)  # MiniMax keeps no cache layer for its last ones
    return ModelLayout(num_layers, attention, states, {i: mixers[i] for i in states})


def _own_state(layer) -> str | None:
    """The methods through which a cache layer class of a model's own (not transformers' ``cache_utils``) keeps state
    beyond K/V (DeepSeek-V4's compressors: ``store_compression_weights``...), or None for transformers' layers."""
    kind = type(layer)
    if kind.__module__ == CacheLayerMixin.__module__:
        return None
    base = next(cls for cls in kind.__mro__ if cls.__module__ == CacheLayerMixin.__module__)
    extra = sorted(name for name in dir(kind) if not name.startswith("_") and not hasattr(base, name))
    return ", ".join(extra) or "a cache layer class of the model's own"


def _state(index: int, layer) -> RecurrentState:
    """The shapes of one linear-attention cache layer's states (batch dimension dropped)."""
    count = layer.number_of_states

    def shape(tensors: dict, i: int) -> StateShape | None:
        tensor = tensors.get(i)
        return StateShape(tuple(tensor.shape[1:]), tensor.dtype) if isinstance(tensor, torch.Tensor) else None

    state = RecurrentState(
        tuple(shape(layer.conv_states, i) for i in range(count)),
        tuple(shape(layer.recurrent_states, i) for i in range(count)),
        tuple(layer.conv_kernel_size.get(i) for i in range(count)),
    )
    if layer.record_past:
        raise LayoutError(f"layer {index} records its past states (for rollback), which hfaccel's state slots do not")
    return state


def wrap_forwards(model, modules: dict[int, str], marker: str, run: Callable) -> None:
    """Give each module ``modules`` names (by layer) a forward of this instance that calls ``run(layer, original,
    arguments, args, kwargs)`` (``arguments``: the call's, by name), marked by the attribute ``marker`` (idempotent);
    :func:`unwrap_forwards` takes them away. How hfaccel runs a layout's mixers and indexers per group of sequences."""
    named = dict(model.named_modules())
    for layer, name in modules.items():
        module = named[name]
        if getattr(module.forward, marker, False):
            continue
        original = module.forward
        names = [
            name
            for name, p in inspect.signature(original).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

        def forward(*args, _layer=layer, _original=original, _names=names, **kwargs):
            return run(_layer, _original, {**dict(zip(_names, args)), **kwargs}, args, kwargs)

        setattr(forward, marker, True)
        module.forward = forward


def unwrap_forwards(model, marker: str) -> None:
    """Undo :func:`wrap_forwards` for the forwards marked ``marker``."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), marker, False):
            del module.forward
