"""Whether hfaccel serves a model, and how: one answer that ``accelerate``, the Engine and the docs' model list read.

A model is served when hfaccel's runner can run it exactly: its attention dispatches through transformers'
``AttentionInterface``, its forward takes each token's position and the logits to keep, what each layer keeps fits
the pool (``hfaccel.kv.layout``: K/V of one width per layer, within the kernels' head sizes, or recurrent state),
its layers attend causally, and a trial — two sequences packed into one forward, then a decode step, on hfaccel's
torch kernels — runs and gives each sequence the last logits transformers' own forward of it alone gives. So a
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
    bidirectional = [layer for layer in sorted(layout.attention) if _attends_both_ways(model, layer)]
    if bidirectional:
        return (
            f"layer {bidirectional[0]}'s attention is not causal (its module's is_causal is False: an encoder's, "
            "or PaliGemma's prefix over the prompt), where hfaccel's prefill is causal"
        )
    return None


def _attends_both_ways(model, layer: int) -> bool:
    """Whether the attention module of decoder ``layer`` says it is not causal (transformers' ``is_causal``); a
    vision-language model's decoder only (its vision encoder attends both ways, as it should)."""
    decoder = (model.get_decoder() if hasattr(model, "get_decoder") else None) or model
    return any(
        getattr(module, "layer_idx", None) == layer and getattr(module, "is_causal", None) is False
        for module in decoder.modules()
    )


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
    return _logits_reason(prefill, _own_logits(model, tokens, (3, 2)))


# the largest difference between the trial's logits and transformers' own, of the largest logit, that is rounding
LOGITS_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
LOGITS_TOLERANCE_16_BIT = 5e-2


def _own_logits(model, tokens: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor | None:
    """transformers' own forward of each of the sequences ``tokens`` packs (``lengths``), alone and unpadded: its
    last token's logits, ``[S, V]``; None where the model cannot run on token ids alone (one that needs its images)."""
    rows, start = [], 0
    try:
        with torch.inference_mode():
            for length in lengths:
                ids = tokens[None, start : start + length]
                rows.append(model(input_ids=ids, use_cache=False).logits[0, -1])
                start += length
    except Exception:
        return None
    return torch.stack(rows)


def _logits_reason(trial: torch.Tensor, own: torch.Tensor | None) -> str | None:
    """Why the trial's prefill logits ``[S, V]`` are not transformers' own (``own``), or None: beyond rounding, the
    model computes something else than what hfaccel passes it (positions counted from its own offset, a mask)."""
    if own is None or own.shape != trial.shape:
        return None
    scale = own.float().abs().amax().clamp(min=1e-6)
    difference = ((trial.float() - own.float()).abs().amax() / scale).item()
    if difference <= LOGITS_TOLERANCE.get(own.dtype, LOGITS_TOLERANCE_16_BIT):
        return None
    return (
        f"hfaccel's packed forward gives other logits than transformers' own forward of each sequence alone (they "
        f"differ by {difference:.1e} of the largest): its positions or attention are not the ones hfaccel passes"
    )
