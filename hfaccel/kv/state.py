"""Recurrent state of hybrid models (Mamba-2, gated delta-net, short-convolution layers...) in state slots.

A hybrid model's recurrent layers keep, per sequence, a convolution state and a recurrent state instead of K/V.
:class:`StatePool` holds them for every sequence of a :class:`~hfaccel.kv.KVPool`, one slot per sequence
(``BlockManager.state_slot``) plus one scratch slot that the padding rows of a static step read and write.

The recurrent layers stay transformers' code. hfaccel's forwards pack every sequence's new tokens into one row
(``[1, T]``), which a recurrent layer would read as one sequence, so each layer's *mixer* (the module that reads and
writes its state, found by ``hfaccel.kv.layout``) is given a forward of this instance (:func:`install_mixers`) that,
under hfaccel's :class:`~hfaccel.kv.SequenceKVCache`, runs transformers' own forward once per group of sequences
that compute as many new tokens and either all have a state or all start one (``[G, L, H]``, a decode step's rows
``[B, 1, H]`` in one group): the group's states gathered from their slots into a transformers ``Cache`` of its own
(:class:`StateView`, transformers' ``LinearAttentionLayer`` per layer, so its padding, concatenation and in-place
rules are transformers'), and written back to the slots afterwards. Under a
:class:`~hfaccel.kv.PromptCache` (a multimodal prompt's prefill through the model's own forward) it runs once on the
padded batch as transformers gives it, every row starting its state, each row's state then stored in its
sequence's slot. Under any other cache the mixer runs as it is.

Whatever follows the packed rows token by token (a LoRA index: ``hfaccel.lora``) is told which packed token each of
a mixer call's rows is: the cache's ``row_followers`` get ``rows [R]`` for the call (the runner gives its LoRA
context), so that LoRA adapters on a mixer's projections apply per sequence as on any other layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from hfaccel.kv.layout import ModelLayout, unwrap_forwards, wrap_forwards

MIXER_FORWARD = "hfaccel_state_mixer"  # the attribute marking a mixer's forward as hfaccel's (install_mixers)


@dataclass(frozen=True)
class StateStep:
    """What a forward's recurrent layers need: each sequence's state slot and, for an eager forward, its groups
    (None: a static step, every sequence one token with its state, the padding rows the scratch slot). A static
    step's ``stores`` (default ``slots``) are where each row's new state goes: a row that reads a sequence's state
    without advancing it (a mirror row, ``DecodeGraphs``) stores to the scratch slot."""

    slots: torch.Tensor  # [S] int64
    groups: tuple[StateGroup, ...] | None = None
    stores: torch.Tensor | None = None  # [S] int64

    def to(self, device: torch.device) -> StateStep:
        groups = None if self.groups is None else tuple(group.to(device) for group in self.groups)
        stores = None if self.stores is None else self.stores.to(device, non_blocking=True)
        return StateStep(self.slots.to(device, non_blocking=True), groups, stores)


@dataclass(frozen=True)
class StateGroup:
    """Sequences of one packed forward that the recurrent layers run together: ``len(slots)`` sequences of
    ``length`` new tokens each, at packed rows ``tokens`` (sequence by sequence); ``fresh``: none has a state yet
    (each starts from the beginning)."""

    tokens: torch.Tensor  # [G * length] int64: rows of the packed forward
    slots: torch.Tensor  # [G] int64: their state slots
    length: int
    fresh: bool

    def to(self, device: torch.device) -> StateGroup:
        return StateGroup(
            self.tokens.to(device, non_blocking=True), self.slots.to(device, non_blocking=True), self.length, self.fresh
        )


def state_groups(slots: Sequence[int], starts: Sequence[int], num_new: Sequence[int]) -> tuple[StateGroup, ...]:
    """The groups of a packed forward whose sequence ``i`` (state slot ``slots[i]``) computes ``num_new[i]`` tokens
    from position ``starts[i]``: by token count and by whether the sequence starts (host tensors)."""
    offsets = [0]
    for n in num_new:
        offsets.append(offsets[-1] + n)
    members: dict[tuple[int, bool], list[int]] = {}
    for i, (start, n) in enumerate(zip(starts, num_new)):
        members.setdefault((n, start == 0), []).append(i)
    return tuple(
        StateGroup(
            torch.tensor([t for i in seqs for t in range(offsets[i], offsets[i + 1])]),
            torch.tensor([slots[i] for i in seqs]),
            length,
            fresh,
        )
        for (length, fresh), seqs in members.items()
    )


class StatePool:
    """Every recurrent layer's state for ``num_slots`` sequences plus a scratch slot (module docstring):
    ``conv[layer][i]`` and ``recurrent[layer][i]`` are ``[num_slots + 1, *shape]`` (None where the layer keeps no
    such state)."""

    def __init__(self, layout: ModelLayout, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a model with recurrent state needs state slots (one per sequence); got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.conv: dict[int, list[torch.Tensor | None]] = {}
        self.recurrent: dict[int, list[torch.Tensor | None]] = {}

    @property
    def scratch(self) -> int:
        """The slot that the padding rows of a static step use."""
        return self.num_slots

    def allocate(self, device: torch.device) -> None:
        def zeros(shape):
            return (
                None
                if shape is None
                else torch.zeros(self.num_slots + 1, *shape.shape, dtype=shape.dtype, device=device)
            )

        for layer, state in self.layout.states.items():
            self.conv[layer] = [zeros(shape) for shape in state.conv]
            self.recurrent[layer] = [zeros(shape) for shape in state.recurrent]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.conv for t in self.conv[layer] + self.recurrent[layer] if t is not None]

    def slot_bytes(self) -> int:
        """Bytes of one slot (one sequence's state, every layer)."""
        return self.layout.state_bytes()

    def copy(self, copies) -> None:
        """Copy slot ``c.src`` into slot ``c.dst`` for each of ``copies`` (a fork's state)."""
        if copies:
            device = self.tensors()[0].device
            src = torch.tensor([c.src for c in copies], device=device)
            dst = torch.tensor([c.dst for c in copies], device=device)
            for tensor in self.tensors():
                tensor[dst] = tensor[src]


class StateView(Cache):
    """A transformers ``Cache`` of ``num_layers`` linear-attention layers, through which one group's states are
    handed to a mixer (transformers' own ``LinearAttentionLayer`` rules apply to them)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[LinearAttentionLayer() for _ in range(num_layers)])
        self.active = 0  # the layer whose mixer runs now

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        # without a layer, transformers asks its last linear-attention layer; here that is the one running
        return super().has_previous_state(self.active if layer_idx is None else layer_idx, state_idx)

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's linear attention reads its state here (its own cache's API): recurrent state 0, None when the
        sequences start."""
        layer = self.layers[layer_idx]
        return layer.recurrent_states[0] if layer.has_previous_state[0] else None

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.layers[layer_idx].recurrent_states[0] = state

    def load(self, pool: StatePool, layer: int, slots: torch.Tensor, fresh: bool) -> None:
        """Give layer ``layer`` the states of ``slots`` (or none yet, ``fresh``)."""
        self.active = layer
        view = self.layers[layer] = LinearAttentionLayer(number_of_states=len(pool.layout.states[layer].conv))
        if fresh:
            return
        kernels = pool.layout.states[layer].conv_kernel_size
        for i, (conv, recurrent) in enumerate(zip(pool.conv[layer], pool.recurrent[layer])):
            if conv is not None:
                view.conv_states[i] = conv.index_select(0, slots)
                view.is_conv_states_initialized[i] = True
                view.conv_kernel_size[i] = kernels[i]
            if recurrent is not None:
                view.recurrent_states[i] = recurrent.index_select(0, slots)
                view.is_recurrent_states_initialized[i] = True
            view.has_previous_state[i] = True

    def store(self, pool: StatePool, layer: int, slots: torch.Tensor) -> None:
        """Write layer ``layer``'s states back to ``slots``."""
        view = self.layers[layer]
        for i, (conv, recurrent) in enumerate(zip(pool.conv[layer], pool.recurrent[layer])):
            if conv is not None and view.conv_states[i] is not None:
                conv.index_copy_(0, slots, view.conv_states[i].to(conv.dtype))
            if recurrent is not None and view.recurrent_states[i] is not None:
                recurrent.index_copy_(0, slots, view.recurrent_states[i].to(recurrent.dtype))


def install_mixers(model, layout: ModelLayout) -> None:
    """Give each mixer of ``layout`` (a hybrid model's recurrent-state modules) hfaccel's forward (module docstring;
    idempotent). :func:`remove_mixers` takes it away."""
    wrap_forwards(model, layout.mixers, MIXER_FORWARD, _mixer_forward)


def remove_mixers(model) -> None:
    """Undo :func:`install_mixers`."""
    unwrap_forwards(model, MIXER_FORWARD)


def _mixer_forward(layer: int, original, arguments: dict, args: tuple, kwargs: dict):
    """One mixer call (``arguments``: the call's, by name): per state group under hfaccel's cache (module
    docstring), else transformers' as it is."""
    cache_name = next(
        (name for name in ("cache", "cache_params", "past_key_values") if _holds_states(arguments.get(name))),
        None,
    )
    if cache_name is None:
        return original(*args, **kwargs)
    cache = arguments[cache_name]
    step = getattr(cache, "states_step", None)
    hidden = arguments.pop(_hidden_name(arguments))  # [1, T, H]; a prompt's: [B, L, H]
    if step is not None:
        for name in arguments:
            if name.endswith("mask"):
                arguments[name] = None  # packed sequences hold no padding (attention_mask; ZAYA's conv_mask)
    call = _MixerCall(original, arguments, cache_name, cache.state_view, cache.pool.states, layer, cache.row_followers)
    if step is None:  # a prompt's prefill through transformers' forward: its rows, padding and mask as they are
        return call.run(hidden, cache.prompt_state_slots, fresh=True)
    if step.groups is None:  # a static step: one token per sequence, each with its state
        # one scratch row more, so that the layer's code never sees a batch of one: its reshapes of views would guard
        # on it, and a compiled step would need a graph of its own for batch 1
        rows = torch.cat([hidden[0], hidden[0, :1]]).unsqueeze(1)  # [B + 1, 1, H]
        scratch = step.slots.new_full((1,), call.pool.scratch)
        slots = torch.cat([step.slots, scratch])  # [B + 1]
        stores = slots if step.stores is None else torch.cat([step.stores, scratch])
        packed_rows = None
        if call.followers:  # the scratch row is a copy of row 0
            packed_rows = torch.arange(rows.shape[0], device=rows.device) % hidden.shape[1]  # [B + 1]
        result = call.run(rows, slots, fresh=False, stores=stores, packed_rows=packed_rows)
        return _packed_outputs(result, rows.shape[:2], lambda out: out[:-1].flatten(0, 1)[None])  # [1, B, ...]
    packed = result = None
    for group in step.groups:
        rows = hidden[0].index_select(0, group.tokens).view(len(group.slots), group.length, -1)  # [G, L, H]
        if group.fresh or group.length == 1 or layer not in call.pool.layout.restarts_chunks:
            result = call.run(rows, group.slots, group.fresh, packed_rows=group.tokens)
        else:  # a mixer that would start this chunk afresh (Mamba-1's): token by token from the state
            result = call.run_token_by_token(rows, group.slots, group.tokens)
        outputs = _outputs(result)
        if packed is None:  # each output of the token layout [G, L, ...] gathered into [1, T, ...]
            packed = [_packed_like(out, rows.shape[:2], hidden.shape[1]) for out in outputs]
        for into, out in zip(packed, outputs):
            if into is not None:
                into[0].index_copy_(0, group.tokens, out.flatten(0, 1))
    return _as_returned(result, packed)


@dataclass
class _MixerCall:
    """One mixer call under hfaccel's cache, run as transformers' forward on groups of rows, each group's states
    loaded from and stored to their slots through ``view`` (passed to the mixer as its ``cache_name`` argument), each
    row's packed token told to the ``followers`` (module docstring)."""

    original: Callable
    arguments: dict
    cache_name: str
    view: StateView
    pool: StatePool
    layer: int
    followers: tuple = ()

    def run(
        self,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        fresh: bool,
        stores: torch.Tensor | None = None,
        packed_rows: torch.Tensor | None = None,
    ):
        """transformers' mixer forward on ``hidden [G, L, H]`` with the states of ``slots`` (none where ``fresh``),
        the new states written to ``stores`` (default ``slots``); its outputs as it returns them (``[G, L, H_out]``
        first). ``packed_rows [G * L]``: the packed token of each row (None: the rows are the packed ones)."""
        self.view.load(self.pool, self.layer, slots, fresh)
        self._follow(packed_rows)
        result = self.original(hidden, **{**self.arguments, self.cache_name: self.view})
        self._follow(None)
        self.view.store(self.pool, self.layer, slots if stores is None else stores)
        return result

    def run_token_by_token(self, hidden: torch.Tensor, slots: torch.Tensor, packed_rows: torch.Tensor):
        """:meth:`run` over ``hidden [G, L, H]`` (packed tokens ``packed_rows [G * L]``) one token at a time (each
        call reading the state the one before wrote), its per-token outputs joined ``[G, L, ...]``, its other outputs
        the last call's."""
        by_token = packed_rows.view(hidden.shape[0], hidden.shape[1])  # [G, L]
        results = [
            self.run(hidden[:, t : t + 1], slots, fresh=False, packed_rows=by_token[:, t])
            for t in range(hidden.shape[1])
        ]
        outputs = [_outputs(result) for result in results]
        rows = hidden[:, :1].shape[:2]  # [G, 1]
        joined = [
            torch.cat([each[i] for each in outputs], dim=1) if _by_token(out, rows) else out
            for i, out in enumerate(outputs[-1])
        ]
        return _as_returned(results[-1], joined)

    def _follow(self, packed_rows: torch.Tensor | None) -> None:
        for follower in self.followers:
            follower.rows = packed_rows


def _holds_states(cache) -> bool:
    """Whether ``cache`` is one of hfaccel's whose recurrent states live in state slots: a packed forward's (its
    ``states_step``) or a prompt's prefill (its ``prompt_state_slots``)."""
    return getattr(cache, "states_step", None) is not None or getattr(cache, "prompt_state_slots", None) is not None


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _by_token(out, rows: torch.Size) -> bool:
    """Whether a mixer output is per token of its rows ``[G, L]`` (hidden states; ZAYA's queries, keys and values),
    rather than a per-group extra (MiniMax's state), which has no packed form."""
    return isinstance(out, torch.Tensor) and out.dim() >= 3 and out.shape[:2] == rows


def _packed_like(out, rows: torch.Size, tokens: int) -> torch.Tensor | None:
    """An empty ``[1, T, ...]`` for a per-token output (``_by_token``), else None."""
    return out.new_empty(1, tokens, *out.shape[2:]) if _by_token(out, rows) else None


def _packed_outputs(result, rows: torch.Size, pack):
    """``result`` in the form the mixer returns, each per-token output packed by ``pack``, the others None."""
    return _as_returned(result, [pack(out) if _by_token(out, rows) else None for out in _outputs(result)])


def _as_returned(result, packed: list):
    """The packed outputs in the form the mixer returns: alone, or a tuple (per-group extras, e.g. MiniMax's state,
    None)."""
    return tuple(packed) if isinstance(result, tuple) else packed[0]


def _hidden_name(arguments: dict) -> str:
    return "hidden_states" if "hidden_states" in arguments else next(iter(arguments))
