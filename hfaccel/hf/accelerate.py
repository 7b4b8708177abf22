"""``hfaccel.accelerate`` / ``hfaccel.restore``: patch one model instance, and undo it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hfaccel import compat
from hfaccel.attention import (
    ATTENTION_NAMES,
    AttentionPaths,
    attention_implementations,
    set_hfaccel_attention,
    text_config_key,
    track_paths,
    untrack_paths,
)
from hfaccel.device import model_device
from hfaccel.distributed import check_sharding
from hfaccel.distributed.quant import quantize_shards
from hfaccel.hf.adapters import LoraState, check_peft_model, prepare_lora
from hfaccel.hf.decode import DecodeInfo, DecodeSession
from hfaccel.hf.generation import install_generate, uninstall_generate
from hfaccel.kernels import resolve_backend
from hfaccel.kernels.runtime import BACKENDS
from hfaccel.quant import quantize as quantize_model
from hfaccel.quant.fp8 import (
    adopt_fp8_layers,
    check_fp8_backend,
    dense_where_no_fp8_kernels,
    fp8_layers,
    fp8_summary,
    put_back,
)
from hfaccel.quant.linear import int4_layers, int4_paths, prepare_int4
from hfaccel.kv.fp8 import KVScales, check_kv_scales, resolve_kv_cache_dtype
from hfaccel.kv.layout import ModelLayout
from hfaccel.kv.latent import remove_absorption
from hfaccel.kv.indexer import install_indexers, remove_indexers
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
        return (
            f"hfaccel: {'language model ' if self.encoders else ''}attention {language!r} -> "
            f"{self.attn_implementation!r} (backend {self.attention!r}){encoders}; {self.layout.describe()}; "
            f"generate(): {self._loop()}"
            f"; last call: {self.decode}"
            f"{'; decode steps: ' + self.session.steps() if self.session is not None else ''}"
            f"; attention calls: {self.attention_paths}"
            f"{'; int4 layers: ' + int4_paths(self.int4_layers) if self.int4_layers else ''}"
            f"{'; fp8 layers: ' + fp8_summary(self.fp8_layers) if self.fp8_layers else ''}"
            f"{'; ' + str(self.lora) if self.lora is not None else ''}"
        )


def accelerate(
    model: PreTrainedModel,
    *,
    attention: str = "auto",
    paged: bool = True,
    quantize: str | None = None,
    calib_data=None,
    group_size: int = 128,
    compile: bool | str = "auto",
    merge_lora: bool = False,
    kv_cache_dtype: str | torch.dtype | None = None,
    kv_scales: KVScales = None,
) -> PreTrainedModel:
    """Serve ``model``'s attention and ``generate()`` by hfaccel; returns the same model object (a ``PeftModel``
    too). Only this instance changes; :func:`restore` undoes it, a second call re-applies with the new arguments.
    Whether hfaccel serves the model exactly is decided here, before any call: one it cannot serve keeps
    transformers' attention, with the reason in ``model.hfaccel`` and a warning (docs/models.md, docs/usage.md).

    Args:
        model: a transformers causal LM or image-text-to-text model (one sharded with ``tp_plan="auto"`` under
            ``torchrun`` too), or a ``PeftModel`` with LoRA adapters wrapping one.
        attention: ``"auto"``: the fastest exact path of the device, per call (hfaccel's Triton kernels on CUDA;
            transformers' SDPA and loop on a CPU, where they are faster); ``"triton"``: always the kernels (a
            ``ValueError`` if the device cannot run them); ``"torch"``: the reference kernels, for checking them.
        paged: ``generate()`` on hfaccel's decode loop over its paged KV pool (what the loop cannot serve, such as
            beam search, runs transformers' loop over a :class:`hfaccel.PagedCache`); ``False``: transformers' loop
            and cache.
        quantize: quantize the Linear layers in place first: int4 ``"rtn"`` / ``"awq"`` / ``"gptq"`` (with
            ``calib_data`` and ``group_size``) or ``"fp8"`` (per-output-channel scales); ``restore`` keeps it.
        compile: compile the decode step (``"auto"``: on CUDA; ``True``: everywhere, on a CPU as transformers'
            static cache with a compiled forward; ``False``: never, CUDA graphs still captured).
        merge_lora: merge a PEFT model's active LoRA adapters into new Linear layers (``restore`` takes them out).
        kv_cache_dtype: the KV pool's storage: ``"auto"`` / None (the model's dtype) or ``"fp8"`` (e4m3).
        kv_scales: an fp8 pool's scales: None (the checkpoint's, else 1.0), a number, or ``"prefill"``.

    Returns:
        ``model``, with ``model.hfaccel`` describing what serves it.
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
        model.hfaccel = Acceleration(
            attention,
            original,
            original,
            fallback_reason=reason,
            lora=lora,
            text_config_key=text_config_key(model.config),
        )
        return given
    set_hfaccel_attention(model, attention)
    if support.layout.hybrid:
        install_mixers(model, support.layout)
    install_indexers(model, support.layout)
    name = ATTENTION_NAMES[attention]
    session = None
    if paged:
        install_generate(model)
        session = DecodeSession(model, compile=compile, **kv_storage)
    layers = int4_layers(model)
    prepare_int4(layers)
    model.hfaccel = Acceleration(
        attention,
        name,
        original,
        paged=paged,
        compile=compile,
        session=session,
        attention_paths=track_paths(model),
        int4_layers=layers,
        fp8_layers=fp8_layers(model),
        fp8_adopted=adopted,
        lora=lora,
        layout=support.layout,
        text_config_key=text_config_key(model.config),
    )
    return given


def _kv_storage(model, paged: bool, kv_cache_dtype, kv_scales: KVScales) -> dict:
    """``accelerate``'s pool dtype and scales (checked before anything changes), as DecodeSession takes them."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_device(model))
    check_kv_scales(kv_scales)
    if dtype is not None and not paged:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is the KV pool of hfaccel's generate() (paged=True); "
            f"with paged=False generate() keeps transformers' cache"
        )
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
        remove_indexers(model)
        remove_absorption(model)
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
        raise TypeError(
            f"hfaccel.accelerate expects a transformers PreTrainedModel (e.g. from "
            f"AutoModelForCausalLM.from_pretrained){also}; got {type(model).__name__}"
        )
    if not model.can_generate():
        raise ValueError(
            f"hfaccel.accelerate expects a causal language model that can generate (e.g. "
            f"AutoModelForCausalLM); got {type(model).__name__}, which cannot generate"
        )
    return model
