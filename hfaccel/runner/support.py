"""Whether hfaccel serves a model, and how: one answer that ``accelerate``, the Engine and the docs' model list read.

A model is served when hfaccel's runner can run it exactly: its attention dispatches through transformers'
``AttentionInterface``, its forward takes each token's position and the logits to keep, what each layer keeps fits
the pool (``hfaccel.kv.layout``: K/V of one width per layer, within the kernels' head sizes, or recurrent state),
and a trial — two sequences packed into one forward, then a decode step, on hfaccel's torch kernels — runs. So a
family hfaccel cannot serve is told before the user's first call, with the reason, and stays on transformers' path;
none is accepted and then broken.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from hfaccel import compat
from hfaccel.attention import hfaccel_attention, unsupported_reason
from hfaccel.device import model_device, per_model
from hfaccel.kernels.flash_attention import MAX_HEAD_DIM
from hfaccel.kv import KVPool
from hfaccel.kv.layout import ModelLayout, model_layout
from hfaccel.runner.step_function import failure_reason
from hfaccel.runner.runner import ModelRunner


@dataclass(frozen=True)
class ModelSupport:
    """hfaccel's answer for one model: its layout where it is served, else why not (``reason``)."""

    layout: ModelLayout | None
    reason: str | None = None

    @property
    def served(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        return f"served: {self.layout.describe()}" if self.served else f"not served: {self.reason}"


_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ((dtype, device), ModelSupport)


def model_support(model) -> ModelSupport:
    """Whether hfaccel serves ``model`` (module docstring); worked out once per model, dtype and device."""
    return per_model(_ANSWERS, model, _support)


def check_served(model, who: str) -> ModelLayout:
    """The model's layout, or a ``ValueError`` saying why ``who`` cannot serve it."""
    support = model_support(model)
    if not support.served:
        raise ValueError(f"{who} cannot serve {type(model).__name__}: {support.reason}")
    return support.layout


def _support(model) -> ModelSupport:
    reason = unsupported_reason(model)
    if reason is not None:
        return ModelSupport(None, reason)
    try:
        layout = model_layout(model)
    except Exception as error:  # the model's own forward over transformers' cache, or a layout the pool cannot hold
        return ModelSupport(None, f"reading what its layers cache failed ({failure_reason(error)})")
    reason = _forward_reason(model, layout) or _layout_reason(model, layout) or _trial_reason(model)
    return ModelSupport(layout, reason)


def _forward_reason(model, layout: ModelLayout) -> str | None:
    """Why the model's forward cannot take hfaccel's packed sequences, or None. Positions are needed where some layer
    attends (a recurrent-only model's layers read their state, not positions)."""
    parameters = inspect.signature(type(model).forward).parameters
    if "position_ids" not in parameters and layout.attention:
        return (
            "its forward takes no position_ids (it derives positions from the cache length), which hfaccel's "
            "packed sequences need"
        )
    if "logits_to_keep" not in parameters:
        return "its forward takes no logits_to_keep (the logits of each sequence's last token)"
    return None


def _layout_reason(model, layout: ModelLayout) -> str | None:
    """Why the pool and kernels cannot hold what the model's layers cache, or None."""
    if not layout.attention and not layout.states:
        return "no layer keeps K/V or recurrent state"
    for layer, kv in sorted(layout.attention.items()):
        if kv.key_dim != kv.value_dim and not kv.latent:
            return (
                f"layer {layer} caches keys {kv.key_dim} wide and values {kv.value_dim} wide, which hfaccel's "
                "kernels do not read"
            )
        if kv.latent and kv.chunk:
            return f"layer {layer} expands latents (MLA) within an attention chunk, which hfaccel does not serve"
        if kv.indexer_dim and kv.window:
            return (
                f"layer {layer}'s sparse-attention indexer works within a sliding window, which hfaccel does not serve"
            )
        if kv.latent and kv.window and _module_window(model, layer) != kv.window:
            return (
                f"layer {layer} expands latents (MLA) within a sliding window its module does not pass to the "
                "attention (hfaccel's packed forward over expanded latents reads it from there)"
            )
        if kv.read_width > MAX_HEAD_DIM:
            return f"layer {layer} has head_dim {kv.read_width}, larger than the kernels' maximum {MAX_HEAD_DIM}"
    if layout.hybrid and compat.tp_size(model) > 1:
        return "recurrent state (a hybrid model) under tensor parallelism is not supported yet"
    return None


def _module_window(model, layer: int) -> int | None:
    """The sliding window the attention module of latent ``layer`` (the one with ``expand_kv``) passes to its
    attention call, as transformers' modules keep it (``sliding_window``)."""
    for module in model.modules():
        if getattr(module, "layer_idx", None) == layer and callable(getattr(module, "expand_kv", None)):
            return getattr(module, "sliding_window", None)
    return None


def _trial_reason(model) -> str | None:
    """Run two sequences (3 and 2 tokens) packed into one forward, then one decode step of each, on hfaccel's torch
    kernels over a small pool; the error it raises, or None."""
    config = model.config.get_text_config(decoder=True)
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    tokens = (torch.arange(5) % (vocab - 1) + 1).to(model_device(model))
    pool = KVPool.for_model(model, num_blocks=4, block_size=16, max_num_seqs=2)
    runner = ModelRunner(model, pool)
    try:
        with hfaccel_attention(model, "torch"), torch.inference_mode():
            prefill = runner.forward([0, 1], tokens, [3, 2])
            decode = runner.forward([0, 1], tokens[:2], [1, 1])
        if prefill.shape[0] != 2 or decode.shape[0] != 2:
            return (
                f"its forward ignores logits_to_keep (logits of {prefill.shape[0]} tokens for the last tokens of "
                "2 sequences)"
            )
    except Exception as error:
        return f"hfaccel's packed forward fails on it ({failure_reason(error)})"
    finally:
        runner.release()
    return None
