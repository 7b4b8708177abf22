"""``hfaccel.accelerate`` / ``hfaccel.restore``: patch one model instance, and undo it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from transformers import PreTrainedModel

from hfaccel import compat
from hfaccel.attention import (
    ATTENTION_NAMES, AttentionPaths, set_hfaccel_attention, track_paths, unsupported_reason, untrack_paths,
)
from hfaccel.device import model_device
from hfaccel.distributed import check_sharding
from hfaccel.distributed.quant import quantize_shards
from hfaccel.hf.decode import DecodeInfo, DecodeSession
from hfaccel.hf.generation import install_generate, uninstall_generate
from hfaccel.kernels import resolve_backend
from hfaccel.kernels.runtime import BACKENDS
from hfaccel.quant import quantize as quantize_model
from hfaccel.quant.linear import int4_layers, int4_paths, prepare_int4
from hfaccel.runner import compiles


@dataclass(frozen=True)
class Acceleration:
    """What :func:`accelerate` did to a model; found on the model as ``model.hfaccel``."""

    attention: str  # the backend asked for: "auto", "triton" or "torch"
    attn_implementation: str  # the attention implementation the model now runs
    original_attn_implementation: str  # what restore() puts back
    fallback_reason: str | None = None  # set when the model was left on transformers' own attention
    paged: bool = False  # generate() runs hfaccel's decode loop / a PagedCache sized for each request
    compile: bool | str = "auto"  # decode steps compiled with torch.compile: "auto" = on CUDA
    session: DecodeSession | None = None  # the runner generate() keeps between calls
    attention_paths: AttentionPaths | None = None  # which path (SDPA, hfaccel's kernels, torch) served each call
    int4_layers: tuple = ()  # the model's Int4Linear layers (their paths are reported)

    @property
    def decode(self) -> DecodeInfo:
        """Which decode loop served the last ``generate`` call, and why when it was transformers'."""
        return self.session.info if self.session is not None else DecodeInfo("transformers", "paged=False")

    @property
    def active(self) -> bool:
        """True when the model's attention runs through hfaccel."""
        return self.fallback_reason is None

    def __str__(self) -> str:
        if not self.active:
            return (f"hfaccel: not accelerated, attention stays {self.original_attn_implementation!r} "
                    f"({self.fallback_reason})")
        return (f"hfaccel: attention {self.original_attn_implementation!r} -> {self.attn_implementation!r} "
                f"(backend {self.attention!r}); generate(): "
                f"{'hfaccel decode loop, paged KV cache, compile=' + repr(self.compile) if self.paged else 'transformers loop and cache'}"
                f"; last call: {self.decode}"
                f"{'; decode steps: ' + self.session.steps() if self.session is not None else ''}"
                f"; attention calls: {self.attention_paths}"
                f"{'; int4 layers: ' + int4_paths(self.int4_layers) if self.int4_layers else ''}")


def accelerate(model: PreTrainedModel, *, attention: str = "auto", paged: bool = True, quantize: str | None = None,
               calib_data=None, group_size: int = 128, compile: bool | str = "auto") -> PreTrainedModel:
    """Make ``model`` run its attention through hfaccel's kernels; returns the same model object.

    Args:
        model: a loaded transformers causal LM (anything ``AutoModelForCausalLM`` gives).
        attention: ``"auto"`` — the fastest exact path of the device, decided per call so the model may move
            between devices: hfaccel's Triton kernels on CUDA (and under ``TRITON_INTERPRET=1``); elsewhere (the
            CPU, MPS) transformers' own SDPA attention, with ``generate()`` on transformers' loop and cache
            (measured faster there than hfaccel's decode loop; ``model.hfaccel.decode`` says so); ``"triton"`` —
            always the Triton kernels (a ``ValueError`` now if the model's device cannot run them); ``"torch"`` —
            the pure-torch reference kernels, for checking them.
        paged: ``generate()`` runs hfaccel's decode loop — the prompt packed into hfaccel's paged KV pool (no
            padding held), static decode steps that read K/V straight from its blocks, transformers' own logits
            processors and stopping criteria; what the loop cannot serve (beam search, ...) runs transformers'
            loop over a :class:`hfaccel.PagedCache` (``False``: transformers' loop and default cache, attention
            still through hfaccel's kernels).
        compile: compile the decode step with ``torch.compile`` (inductor fuses the glue between hfaccel's
            kernels) — ``"auto"``: on CUDA; ``True``: on every device; ``False``: never (on CUDA the steps are
            still captured as CUDA graphs). The first call per batch / context bucket compiles.
        quantize: quantize the Linear layers to int4 in place first (``hfaccel.quantize`` with this method,
            ``calib_data`` and ``group_size``); ``restore`` does not undo quantization.

    A model transformers sharded with ``tp_plan="auto"`` (under ``torchrun``) is served on every rank: attention
    over the rank's local heads, a KV pool of its local KV heads, and ``generate()`` called on every rank with the
    same arguments runs hfaccel's loop in lockstep, each step's tokens rank 0's; ``quantize="rtn"`` there quantizes
    each rank's shard (the single-process int4 weights exactly, or a ``ValueError`` naming a layer whose shard is
    not whole int4 groups). A model spread over devices by
    ``device_map``, or a TP size that does not divide the KV heads, is a ``ValueError``.

    Only this model instance changes (its config's attention implementation). Generation, ``model(...)``
    and pipelines keep working and give the same results. An architecture hfaccel cannot serve is left
    on transformers' attention with a warning that names the reason (see ``model.hfaccel``).
    Calling ``accelerate`` again re-applies it with the new arguments; :func:`restore` undoes it.
    """
    _check_model(model)
    check_sharding(model, quantize=quantize)
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}; got {attention!r}")
    if attention == "triton":
        resolve_backend("triton", model_device(model))
    if quantize is not None and compat.tp_size(model) > 1:
        quantize_shards(model, quantize, group_size=group_size)  # each rank its shard
    elif quantize is not None:
        quantize_model(model, quantize, calib_data=calib_data, group_size=group_size)
    if isinstance(getattr(model, "hfaccel", None), Acceleration):
        restore(model)
    original = compat.attn_implementation(model.config)
    reason = unsupported_reason(model)
    if reason is not None:
        warnings.warn(f"hfaccel: {type(model).__name__} keeps its {original!r} attention: {reason}", stacklevel=2)
        model.hfaccel = Acceleration(attention, original, original, fallback_reason=reason)
        return model
    compiles(compile, model_device(model))  # a bad setting raises before anything changes
    set_hfaccel_attention(model, attention)
    name = ATTENTION_NAMES[attention]
    session = None
    if paged:
        install_generate(model)
        session = DecodeSession(model, compile=compile)
    layers = int4_layers(model)
    prepare_int4(layers)
    model.hfaccel = Acceleration(attention, name, original, paged=paged, compile=compile, session=session,
                                 attention_paths=track_paths(model), int4_layers=layers)
    return model


def restore(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`accelerate` on ``model`` (a no-op on a model that was never accelerated)."""
    info = getattr(model, "hfaccel", None)
    if not isinstance(info, Acceleration):
        return model
    if info.active:
        model.set_attn_implementation(info.original_attn_implementation)
        untrack_paths(model)
    uninstall_generate(model)
    if info.session is not None:
        info.session.release()  # its KV pools and compiled steps, now rather than at the next collection
    del model.hfaccel
    return model


def _check_model(model) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hfaccel.accelerate expects a transformers PreTrainedModel (e.g. from "
                        f"AutoModelForCausalLM.from_pretrained); got {type(model).__name__}")
    if not model.can_generate():
        raise ValueError(f"hfaccel.accelerate expects a causal language model that can generate (e.g. "
                         f"AutoModelForCausalLM); got {type(model).__name__}, which cannot generate")
