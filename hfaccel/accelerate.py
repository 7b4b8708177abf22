"""``hfaccel.accelerate`` / ``hfaccel.restore``: patch one model instance, and undo it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hfaccel import attention as attention_impl
from hfaccel import compat
from hfaccel.generation import install_paged_generate, uninstall_paged_generate
from hfaccel.kernels import resolve_backend
from hfaccel.kernels.flash_attention import MAX_HEAD_DIM
from hfaccel.kernels.runtime import BACKENDS


@dataclass(frozen=True)
class Acceleration:
    """What :func:`accelerate` did to a model; found on the model as ``model.hfaccel``."""

    attention: str  # the backend asked for: "auto", "triton" or "torch"
    attn_implementation: str  # the attention implementation the model now runs
    original_attn_implementation: str  # what restore() puts back
    fallback_reason: str | None = None  # set when the model was left on transformers' own attention
    paged: bool = False  # generate() supplies a PagedCache sized for each request

    @property
    def active(self) -> bool:
        """True when the model's attention runs through hfaccel."""
        return self.fallback_reason is None

    def __str__(self) -> str:
        if not self.active:
            return (f"hfaccel: not accelerated, attention stays {self.original_attn_implementation!r} "
                    f"({self.fallback_reason})")
        return (f"hfaccel: attention {self.original_attn_implementation!r} -> {self.attn_implementation!r} "
                f"(backend {self.attention!r}), {'paged' if self.paged else 'default'} KV cache in generate()")


def accelerate(model: PreTrainedModel, *, attention: str = "auto", paged: bool = True, quantize: str | None = None,
               calib_data=None, group_size: int = 128) -> PreTrainedModel:
    """Make ``model`` run its attention through hfaccel's kernels; returns the same model object.

    Args:
        model: a loaded transformers causal LM (anything ``AutoModelForCausalLM`` gives).
        attention: ``"auto"`` — Triton on CUDA (and under ``TRITON_INTERPRET=1``), the torch reference on
            other devices, decided per call so the model may move between devices; ``"triton"`` — always
            the Triton kernels (a ``ValueError`` now if the model's device cannot run them); ``"torch"`` —
            the pure-torch reference kernels.
        paged: ``generate()`` without a cache argument uses a :class:`hfaccel.PagedCache` sized for the
            request, and decode steps read K/V straight from its blocks (``False``: transformers' default
            cache, attention still through hfaccel's kernels).
        quantize: quantize the Linear layers to int4 in place first (``hfaccel.quantize`` with this method,
            ``calib_data`` and ``group_size``); ``restore`` does not undo quantization.

    Only this model instance changes (its config's attention implementation). Generation, ``model(...)``
    and pipelines keep working and give the same results. An architecture hfaccel cannot serve is left
    on transformers' attention with a warning that names the reason (see ``model.hfaccel``).
    Calling ``accelerate`` again re-applies it with the new arguments; :func:`restore` undoes it.
    """
    _check_model(model)
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}; got {attention!r}")
    if attention == "triton":
        resolve_backend("triton", _model_device(model))
    if quantize is not None:
        from hfaccel.quant import quantize as quantize_model

        quantize_model(model, quantize, calib_data=calib_data, group_size=group_size)
    if isinstance(getattr(model, "hfaccel", None), Acceleration):
        restore(model)
    original = model.config._attn_implementation
    reason = unsupported_reason(model)
    if reason is not None:
        warnings.warn(f"hfaccel: {type(model).__name__} keeps its {original!r} attention: {reason}", stacklevel=2)
        model.hfaccel = Acceleration(attention, original, original, fallback_reason=reason)
        return model
    attention_impl.register()
    name = attention_impl.ATTENTION_NAMES[attention]
    model.set_attn_implementation(name)
    if paged:
        install_paged_generate(model)
    model.hfaccel = Acceleration(attention, name, original, paged=paged)
    return model


def restore(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`accelerate` on ``model`` (a no-op on a model that was never accelerated)."""
    info = getattr(model, "hfaccel", None)
    if not isinstance(info, Acceleration):
        return model
    if info.active:
        model.set_attn_implementation(info.original_attn_implementation)
    uninstall_paged_generate(model)
    del model.hfaccel
    return model


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why hfaccel cannot serve this model's attention, or None when it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (hfaccel serves decoder-only causal LMs)"
    if getattr(config, "sub_configs", None):
        return f"composite (multimodal) models are not supported yet (sub-configs: {sorted(config.sub_configs)})"
    if not compat.can_set_attn_implementation(model):
        return "its modeling code does not dispatch attention through transformers' AttentionInterface"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks (s_aux) are not implemented by hfaccel's kernels"
    head_dim = _head_dim(config)
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is larger than the kernels' maximum {MAX_HEAD_DIM}"
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != head_dim:
        return f"query/key head_dim ({head_dim}) differs from value head_dim ({v_head_dim})"
    return None


def _check_model(model) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hfaccel.accelerate expects a transformers PreTrainedModel (e.g. from "
                        f"AutoModelForCausalLM.from_pretrained); got {type(model).__name__}")
    if not model.can_generate():
        raise ValueError(f"hfaccel.accelerate expects a causal language model that can generate (e.g. "
                         f"AutoModelForCausalLM); got {type(model).__name__}, which cannot generate")


def _head_dim(config) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def _model_device(model: PreTrainedModel) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
