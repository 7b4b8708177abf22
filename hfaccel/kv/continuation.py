"""Which recurrent layers restart a chunk: mixers that read their state for one new token but start a chunk of
several afresh (transformers' Mamba-1 continues its convolution but not its scan), found by continuing the layout
probe's cache (``hfaccel.kv.layout``): their continuing chunks run token by token (``hfaccel.kv.state``) and the
engine computes such a model's prompts whole."""

from __future__ import annotations

import copy
import logging

import torch
from transformers.cache_utils import DynamicCache

from hfaccel import compat
from hfaccel.device import model_device

_log = logging.getLogger("hfaccel")


def chunk_restarting_layers(model, cache: DynamicCache, mixers: dict[int, str]) -> frozenset[int]:
    """Of the state layers ``mixers`` names (each with its mixer module's name), those that restart a chunk
    (``ModelLayout.restarts_chunks``), decided per mixer class (the class's code decides) by
    :meth:`_Continuation.restarts`; every one of them where the continuations cannot run (with a warning)."""
    if not mixers:
        return frozenset()
    named = dict(model.named_modules())
    classes: dict[type, list[int]] = {}
    for layer in sorted(mixers):
        classes.setdefault(type(named[mixers[layer]]), []).append(layer)
    try:
        continuation = _Continuation(model, cache)
        return frozenset(layer for layers in classes.values() if continuation.restarts(layers) for layer in layers)
    except Exception as error:  # the model's code cannot continue its cache so: run every chunk token by token
        _log.warning(
            "hfaccel: %s's continuations of a cached state fail (%s): its recurrent layers run prompt chunks token "
            "by token",
            type(model).__name__,
            error,
        )
        return frozenset(mixers)


READ_CHANGE = 1e-4  # noise in a state tensor moving the logits by more than this share of their largest: it is read
UNREAD_CHANGE = 5e-2  # ... over two new tokens by less than this share of what it moved them over one: not for two


class _Continuation:
    """Continuations of a probe's cache (:func:`chunk_restarting_layers`) by a few ordinary tokens, over copies
    of it."""

    def __init__(self, model, cache: DynamicCache):
        self.model, self.cache = model, cache
        self.base: dict[int, torch.Tensor] = {}
        text = model.config.get_text_config(decoder=True)
        draw = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(text.vocab_size, (1, 2), generator=draw).to(model_device(model))  # [1, 2]

    def restarts(self, layers: list[int]) -> bool:
        """Whether the mixers of ``layers`` (one class) restart a chunk: some state tensor, in the first of the
        layers where loud noise in it moves the logits of one new token (:data:`READ_CHANGE`), moves those of two
        new tokens (the first the same) by less than :data:`UNREAD_CHANGE` of that."""
        for which in range(len(_state_tensors(self.cache, layers[0]))):
            for layer in layers:
                one = self.change(1, layer, which)
                if one > READ_CHANGE:
                    if self.change(2, layer, which) < UNREAD_CHANGE * one:
                        return True
                    break
        return False

    def change(self, length: int, layer: int, which: int) -> float:
        """How far noise in state tensor ``which`` of ``layer`` moves the logits of ``length`` new tokens, as a
        share of their largest."""
        if length not in self.base:
            self.base[length] = self.logits(length)
        base = self.base[length]
        return float((self.logits(length, layer, which) - base).abs().max() / base.abs().max())

    def logits(self, length: int, layer: int | None = None, which: int = 0) -> torch.Tensor:
        continued = copy.deepcopy(self.cache)
        if layer is not None:
            state = _state_tensors(continued, layer)[which]
            state.copy_(torch.randn(state.shape, generator=torch.Generator().manual_seed(layer)).to(state) * 10)
        kwargs = {compat.cache_argument(self.model): continued}
        return self.model(input_ids=self.tokens[:, :length], use_cache=True, **kwargs).logits.float()


def _state_tensors(cache: DynamicCache, layer: int) -> list[torch.Tensor]:
    """The recurrent-state tensors a cache holds for ``layer`` (MiniMax's own cache: its ``linear_cache`` entry)."""
    own = getattr(cache, "linear_cache", ())
    if layer < len(own) and isinstance(own[layer], torch.Tensor):
        return [own[layer]]
    held = cache.layers[layer]
    states = [*getattr(held, "conv_states", {}).values(), *getattr(held, "recurrent_states", {}).values()]
    return [state for state in states if isinstance(state, torch.Tensor)]
