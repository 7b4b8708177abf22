"""``hfaccel.accelerate`` / ``hfaccel.restore``: patch one model instance, and undo it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hfaccel import compat
from hfaccel.attention import (ATTENTION_NAMES, AttentionPaths, attention_implementations, set_hfaccel_attention,
                               text_config_key, track_paths, untrack_paths)
from hfaccel.device import model_device
from hfaccel.distributed import check_sharding
from hfaccel.distributed.quant import quantize_shards
from hfaccel.hf.adapters import LoraState, check_peft_model, prepare_lora
from hfaccel.hf.decode import DecodeInfo, DecodeSession
from hfaccel.hf.generation import install_generate, uninstall_generate
from hfaccel.kernels import resolve_backend
from hfaccel.kernels.runtime import BACKENDS
from hfaccel.quant import quantize as quantize_model
from hfaccel.quant.fp8 import (adopt_fp8_layers, check_fp8_backend, dense_where_no_fp8_kernels, fp8_layers,
                               fp8_summary, put_back)
from hfaccel.quant.linear import int4_layers, int4_paths, prepare_int4
from hfaccel.kv.fp8 import KVScales, check_kv_scales, resolve_kv_cache_dtype
from hfaccel.kv.layout import ModelLayout
from hfaccel.kv.state import install_mixers, remove_mixers
from hfaccel.runner import compiles
from hfaccel.runner.support import model_support


@dataclass(frozen=True)
class Acceleration:
    """What :func:`accelerate` did to a model; found on the model as ``model.hfaccel``."""

    attention: str  # the backend asked for: "auto", "triton" or "torch"
    attn_implementation: str  # the attention implementation the model (a multimodal one's language model) now runs
    # what restore() puts back: the model's implementation, or a multimodal model's per sub-config ("": its own)
    original_attn_implementation: str | dict[str, str]
    fallback_reason: str | None = None  # set when the model was left on transformers' own attention
    paged: bool = False  # generate() runs hfaccel's decode loop / a PagedCache sized for each request
    compile: bool | str = "auto"  # decode steps compiled with torch.compile: "auto" = on CUDA
    session: DecodeSession | None = None  # the runner generate() keeps between calls
    attention_paths: AttentionPaths | None = None  # which path (SDPA, hfaccel's kernels, torch) served each call
    int4_layers: tuple = ()  # the model's Int4Linear layers (their paths are reported)
    fp8_layers: tuple = ()  # the model's Fp8Linear layers (their scales' granularity is reported)
    fp8_adopted: tuple = ()  # (name, transformers' fp8 layer) each Fp8Linear replaced; restore() puts them back
    lora: LoraState | None = None  # the model's PEFT LoRA layers (merged by hfaccel or not)
    layout: ModelLayout | None = None  # what each layer keeps (K/V of which shape, recurrent state)
    text_config_key: str | None = None  # a multimodal model's language-model sub-config ("text_config")

    @property
    def decode(self) -> DecodeInfo:
        """Which decode loop served the last ``generate`` call, and why when it was transformers'."""
        return self.session.info if self.session is not None else DecodeInfo("transformers", "paged=False")

    @property
    def encoders(self) -> dict[str, str]:
        """A multimodal model's encoders (vision, audio: their sub-config names) and the attention they keep, which
        is transformers' (empty for a text-only model)."""
        original = self.original_attn_implementation
        if isinstance(original, str):
            return {}
        return {key: name for key, name in original.items() if key and key != self.text_config_key}

    @property
    def active(self) -> bool:
        """True when the model's attention runs through hfaccel."""
        return self.fallback_reason is None

    def _loop(self) -> str:
        if not self.paged:
            return "transformers loop and cache"
        dtype = self.session.kv_cache_dtype
        stored = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
        return f"hfaccel decode loop, paged KV cache{stored}, compile={self.compile!r}"

    def __str__(self) -> str:
        original = self.original_attn_implementation
        language = original if isinstance(original, str) else original[self.text_config_key]
        if not self.active:
            return f"hfaccel: not accelerated, attention stays {language!r} ({self.fallback_reason})"
        encoders = "".join(f"; {key} keeps transformers' {name!r} attention" for key, name in self.encoders.items())
        return (f"hfaccel: {'language model ' if self.encoders else ''}attention {language!r} -> "
                f"{self.attn_implementation!r} (backend {self.attention!r}){encoders}; {self.layout.describe()}; "
                f"generate(): {self._loop()}"
                f"; last call: {self.decode}"
                f"{'; decode steps: ' + self.session.steps() if self.session is not None else ''}"
                f"; attention calls: {self.attention_paths}"
                f"{'; int4 layers: ' + int4_paths(self.int4_layers) if self.int4_layers else ''}"
                f"{'; fp8 layers: ' + fp8_summary(self.fp8_layers) if self.fp8_layers else ''}"
                f"{'; ' + str(self.lora) if self.lora is not None else ''}")


def accelerate(model: PreTrainedModel, *, attention: str = "auto", paged: bool = True, quantize: str | None = None,
               calib_data=None, group_size: int = 128, compile: bool | str = "auto",
               merge_lora: bool = False, kv_cache_dtype: str | torch.dtype | None = None,
               kv_scales: KVScales = None) -> PreTrainedModel:
    """Make ``model`` run its attention through hfaccel's kernels; returns the same model object.

    Args:
        model: a loaded transformers causal LM (anything ``AutoModelForCausalLM`` gives), or a peft ``PeftModel``
            with LoRA adapters wrapping one (see "PEFT models" below).
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
            still captured as CUDA graphs). The first call compiles (one graph serves every batch size). Where
            transformers' loop is the faster path (``auto`` attention without Triton: the CPU, MPS), ``True``
            runs it over transformers' static cache with the decode forward compiled (its own
            ``cache_implementation="static"`` + compile, on every device, the cache sized by powers of two; a new
            batch size or a request past the cache compiles again), unless the call chose a cache, a compile
            config or ``disable_compile``.
        quantize: quantize the Linear layers in place first (``hfaccel.quantize`` with this method, ``calib_data``
            and ``group_size``): int4 (``"rtn"``, ``"awq"``, ``"gptq"``) or fp8 (``"fp8"``: e4m3 weights, one scale
            per output channel); ``restore`` does not undo quantization.
        merge_lora: for a PEFT model, merge the active LoRA adapters into the weights (below); a ``ValueError`` for a
            model without LoRA layers.
        kv_cache_dtype: how ``generate()``'s KV pool stores keys and values (``paged`` only): ``"auto"`` / None, the
            model's dtype; ``"fp8"`` (or ``torch.float8_e4m3fn``), e4m3 with per-KV-head scales, half the bytes of
            16-bit (a GPU of sm_89 or later, or the CPU). Every call then runs on the fp8 pool: hfaccel's loop, or
            transformers' loop over a ``PagedCache`` in fp8 (where it is the faster path it yields to the fp8 pool).
        kv_scales: an fp8 pool's scales: None — the checkpoint's (``k_scale`` / ``v_scale`` of the attention
            modules), else 1.0; a number; or ``"prefill"`` — each layer's from its first prefill (``hfaccel.kv.fp8``).

    fp8 models: transformers' own fp8 layers (a block-FP8 or FBGEMM fp8 checkpoint loaded on a GPU; on a CPU
    transformers dequantizes them) are replaced by hfaccel's ``Fp8Linear``, their weights and scales as they are, and
    ``restore`` puts them back; a model from ``hfaccel.load_quantized`` has ``Fp8Linear`` layers already.

    PEFT models: ``accelerate(peft_model)`` accelerates the transformers model the ``PeftModel`` wraps
    (``peft_model.get_base_model()``), its LoRA layers in place, and returns ``peft_model``; ``peft_model.generate``
    then runs hfaccel's loop, and ``peft_model.hfaccel`` describes it (the LoRA layers and adapters included).
    Unmerged (the default), PEFT's API keeps working: ``set_adapter``, ``disable_adapter()``, ``load_adapter``
    between calls — each ``generate`` reads the layers' adapter state and runs decode steps made for it (compiled
    and captured steps are kept per state). A call with ``adapter_names`` (adapters mixed in a batch) runs
    transformers' loop. ``merge_lora=True`` replaces each LoRA layer by a new Linear layer holding
    ``W + scaling * B @ A`` of the active adapters (computed in fp32, cast to the weight's dtype): no adapter work
    per token, the user's weights untouched (the LoRA layers are kept, so the merged layers cost their memory
    again) and adapters fixed until ``restore``, which puts the LoRA layers back. ``quantize="rtn"`` on an unmerged
    model quantizes the base layers (each LoRA layer's ``base_layer``) and keeps the adapters (``lora_A`` /
    ``lora_B``), ``modules_to_save`` and the embeddings in their dtype (QLoRA-style); AWQ / GPTQ calibrate only
    with ``merge_lora=True``. Plain LoRA only: a PEFT model of another method (prompt tuning, IA3...) or an active
    DoRA / aLoRA adapter is a ``ValueError`` (merge those with ``peft_model.merge_and_unload()`` first), as is
    ``merge_lora`` of LoRA on an Embedding or another non-Linear layer.

    A model transformers sharded with ``tp_plan="auto"`` (under ``torchrun``) is served on every rank: attention
    over the rank's local heads, a KV pool of its local KV heads, and ``generate()`` called on every rank with the
    same arguments runs hfaccel's loop in lockstep, each step's tokens rank 0's; ``quantize="rtn"`` there quantizes
    each rank's shard (the single-process int4 weights exactly, or a ``ValueError`` naming a layer whose shard is
    not whole int4 groups). A model spread over devices by
    ``device_map``, or a TP size that does not divide the KV heads, is a ``ValueError``.

    Only this model instance changes (its config's attention implementation; a hybrid model's recurrent layers get
    a forward of this instance that runs them per sequence under hfaccel's loop, ``hfaccel.kv.state``). Generation,
    ``model(...)`` and pipelines keep working and give the same results. Whether hfaccel serves the model is decided
    here, before any call (``hfaccel.runner.support``: what its layers cache, read off one forward of one token, and a
    trial of two packed sequences on hfaccel's torch kernels); a model it cannot serve is left on transformers'
    attention with a warning that names the reason (see ``model.hfaccel``; docs/models.md lists every family).
    Calling ``accelerate`` again re-applies it with the new arguments; :func:`restore` undoes it.
    """
    given, model = model, _check_model(model)  # a PeftModel's wrapped transformers model is the one accelerated
    check_sharding(model, quantize=quantize)
    if attention not in BACKENDS:
        raise ValueError(f"attention must be one of {BACKENDS}; got {attention!r}")
    if attention == "triton":
        resolve_backend("triton", model_device(model))
    check_fp8_backend(model, attention, quantize)
    compiles(compile, model_device(model))  # a bad setting raises before anything changes
    kv_storage = _kv_storage(model, paged, kv_cache_dtype, kv_scales)
    if isinstance(getattr(model, "hfaccel", None), Acceleration):
        restore(model)  # first: it puts back LoRA layers an earlier merge_lora=True replaced
    lora = prepare_lora(given, model, merge_lora=merge_lora, quantize=quantize)  # raises before anything changes
    if merge_lora:
        lora.merge()
    _quantize(model, quantize, calib_data, group_size, lora)
    adopted = tuple(adopt_fp8_layers(model, model.dtype))  # transformers' fp8 layers -> hfaccel's kernels
    dense_where_no_fp8_kernels(model, model.dtype)
    original = attention_implementations(model)
    support = model_support(model)
    reason = support.reason
    if reason is not None:
        put_back(model, list(adopted))
        warnings.warn(f"hfaccel: {type(model).__name__} keeps its {original!r} attention: {reason}", stacklevel=2)
        model.hfaccel = Acceleration(attention, original, original, fallback_reason=reason, lora=lora,
                                     text_config_key=text_config_key(model.config))
        return given
    set_hfaccel_attention(model, attention)
    if support.layout.hybrid:
        install_mixers(model, support.layout)
    name = ATTENTION_NAMES[attention]
    session = None
    if paged:
        install_generate(model)
        session = DecodeSession(model, compile=compile, **kv_storage)
    layers = int4_layers(model)
    prepare_int4(layers)
    model.hfaccel = Acceleration(attention, name, original, paged=paged, compile=compile, session=session,
                                 attention_paths=track_paths(model), int4_layers=layers,
                                 fp8_layers=fp8_layers(model), fp8_adopted=adopted, lora=lora,
                                 layout=support.layout, text_config_key=text_config_key(model.config))
    return given


def _kv_storage(model, paged: bool, kv_cache_dtype, kv_scales: KVScales) -> dict:
    """``accelerate``'s pool dtype and scales (checked before anything changes), as DecodeSession takes them."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_device(model))
    check_kv_scales(kv_scales)
    if dtype is not None and not paged:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is the KV pool of hfaccel's generate() (paged=True); "
                         f"with paged=False generate() keeps transformers' cache")
    if kv_scales is not None and dtype is None:
        raise ValueError(f"kv_scales={kv_scales!r} needs an fp8 KV pool (kv_cache_dtype='fp8')")
    return {"kv_cache_dtype": dtype, "kv_scales": kv_scales}


def _quantize(model, method: str | None, calib_data, group_size: int, lora: LoraState | None) -> None:
    """``accelerate``'s ``quantize``: each TP rank its shard, or the whole model — never a LoRA adapter's layers."""
    if method is not None and compat.tp_size(model) > 1:
        quantize_shards(model, method, group_size=group_size)  # each rank its shard
    elif method is not None:
        skip = {"skip": lora.quantize_skip()} if lora is not None else {}
        quantize_model(model, method, calib_data=calib_data, group_size=group_size, **skip)


def restore(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`accelerate` on ``model`` (a no-op on a model that was never accelerated); returns ``model``. A
    ``PeftModel`` gets back its wrapped model's attention and ``generate``, and the LoRA layers a
    ``merge_lora=True`` replaced (the same modules, their weights never changed); transformers' fp8 layers come
    back likewise."""
    given = model
    if compat.is_peft_model(model):
        model = compat.peft_base_model(model)
    info = getattr(model, "hfaccel", None)
    if not isinstance(info, Acceleration):
        return given
    if info.active:
        model.set_attn_implementation(info.original_attn_implementation)
        untrack_paths(model)
        remove_mixers(model)
    uninstall_generate(model)
    if info.session is not None:
        info.session.release()  # its KV pools and compiled steps, now rather than at the next collection
    if info.lora is not None:
        info.lora.unmerge()
    put_back(model, list(info.fp8_adopted))
    del model.hfaccel
    return given


def _check_model(model) -> PreTrainedModel:
    """The transformers model ``accelerate`` patches: ``model``, or the one a LoRA ``PeftModel`` wraps."""
    if compat.is_peft_model(model):
        check_peft_model(model)
        model = compat.peft_base_model(model)
    if not isinstance(model, PreTrainedModel):
        also = " or a peft PeftModel with LoRA adapters wrapping one" if compat.from_peft(model) else ""
        raise TypeError(f"hfaccel.accelerate expects a transformers PreTrainedModel (e.g. from "
                        f"AutoModelForCausalLM.from_pretrained){also}; got {type(model).__name__}")
    if not model.can_generate():
        raise ValueError(f"hfaccel.accelerate expects a causal language model that can generate (e.g. "
                         f"AutoModelForCausalLM); got {type(model).__name__}, which cannot generate")
    return model
