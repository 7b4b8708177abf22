"""Where hfaccel depends on a detail of transformers that moves between releases: private names, renamed
arguments, features a release added. Supported: 5.17 (CI's lowest environment) through the newest 5.x. Each shim
says which releases it exists for and which floor deletes it.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface, PreTrainedModel, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa_attention  # noqa: F401

TRANSFORMERS_VERSION = Version(transformers.__version__)
MIN_TRANSFORMERS = Version("5.17.0")


def check_transformers_version() -> None:
    """Raise a clear error on a transformers release hfaccel was not built for."""
    if not (MIN_TRANSFORMERS <= TRANSFORMERS_VERSION < Version("6")):
        raise ImportError(f"hfaccel needs transformers >= {MIN_TRANSFORMERS}, < 6; found {TRANSFORMERS_VERSION}")


# ---- the cache argument: ``past_key_values`` until 5.23, ``cache`` from 5.24 (the old name a deprecated alias);
# Mamba's models took theirs as ``cache_params`` before 5.24; delete at a 5.24 floor ----
# every name a model or generate() call may carry its cache under
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


@functools.lru_cache(maxsize=None)
def _cache_parameter(forward) -> str:
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), "past_key_values")


def cache_argument(model) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``"cache"`` for a model class written for
    transformers >= 5.24, ``"past_key_values"`` before (and for remote code that still uses the old name),
    ``"cache_params"`` for Mamba's models before 5.24. Passing the old name to a new model works but warns, so
    hfaccel's own calls use this one."""
    return _cache_parameter(type(model).forward)


def generate_cache_argument() -> str:
    """The name ``generate()`` of the installed transformers takes a cache under without a deprecation warning."""
    from transformers.generation.utils import GenerationMixin

    return _cache_parameter(GenerationMixin.prepare_inputs_for_generation)


def given_cache(kwargs: dict):
    """The cache a ``generate()`` / forward call's keyword arguments carry, under either name (None if none)."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` less any cache argument, under either name."""
    return {k: v for k, v in kwargs.items() if k not in CACHE_ARGUMENTS}


def output_cache(output):
    """The cache a model or ``generate()`` output returned (``cache`` from 5.24, ``past_key_values`` before)."""
    fields = output.keys() if hasattr(output, "keys") else ()
    for name in CACHE_ARGUMENTS:
        if name in fields:
            return output[name]
    return None


def register_attention(name: str, attention_fn: Callable, mask_fn: Callable) -> None:
    """Register an attention function and its mask function under ``name`` (a name of hfaccel's own)."""
    if attention_function(name) is attention_fn:
        return
    AttentionInterface.register(name, attention_fn)
    masking_utils.AttentionMaskInterface.register(name, mask_fn)


def attn_implementation(config) -> str | None:
    """The attention implementation a model config selects (transformers keeps it in a private field)."""
    return getattr(config, "_attn_implementation", None)


def attention_function(name: str | None) -> Callable | None:
    """The function registered in transformers' ``AttentionInterface`` under ``name`` (None if none is)."""
    return AttentionInterface._global_mapping.get(name) if name is not None else None


def can_set_attn_implementation(model: PreTrainedModel) -> bool:
    """Whether the model class routes attention through ``AttentionInterface`` (so a custom name takes effect)."""
    probe = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(probe()) if callable(probe) else bool(getattr(model, "_supports_attention_backend", False))


def dense_bool_mask(**mask_kwargs) -> torch.Tensor | None:
    """transformers' own 4-D bool mask ``[B, 1, Sq, Skv]`` (True = attend) for any mask pattern."""
    mask_kwargs["allow_is_causal_skip"] = False
    mask_kwargs.pop("allow_is_bidirectional_skip", None)
    return masking_utils.sdpa_mask(**mask_kwargs)


def sdpa_mask(**mask_kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa`` mask function as it is (None where SDPA's ``is_causal`` or no mask computes it)."""
    return masking_utils.sdpa_mask(**mask_kwargs)


def padding_mask(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """The 2-D padding mask ``[B, kv_offset + kv_length]`` indexed by absolute key position (or None)."""
    return masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)


@dataclass(frozen=True)
class MaskPattern:
    """An index-based mask pattern the kernels implement natively."""

    causal: bool
    sliding_window: int | None = None


def describe_mask_function(mask_function: Callable, local_size: int | None, config=None) -> MaskPattern | None:
    """Recognise transformers' causal / bidirectional / sliding-window mask functions; None for anything else.

    Anything unrecognised (chunked attention, packed sequences, image-token overlays, user functions) returns
    None and is served from a dense mask, so a new pattern costs speed, never correctness. ``config`` (the model
    config transformers' mask creators pass) is read only while dynamo traces (see :func:`_describe_traced`).
    """
    if mask_function is masking_utils.causal_mask_function:
        return MaskPattern(causal=True)
    if mask_function is masking_utils.bidirectional_mask_function:
        return MaskPattern(causal=False)
    if torch.compiler.is_compiling():
        return _describe_traced(mask_function, local_size, config)
    parts = _and_mask_parts(mask_function)
    if parts is None or len(parts) != 2 or local_size is None:
        return None
    overlay, base = parts
    window = _closure_value(overlay, "sliding_window")
    if window != local_size:
        return None
    if base is masking_utils.causal_mask_function and _same_code(overlay, masking_utils.sliding_window_overlay(1)):
        return MaskPattern(causal=True, sliding_window=int(window))
    return None


def _describe_traced(mask_function: Callable, local_size: int | None, config) -> MaskPattern | None:
    """The pattern of a mask function built inside a graph dynamo traces, whose closure cannot be read there.

    transformers builds the causal sliding-window function as ``and_masks(sliding_window_overlay(w),
    causal_mask_function)`` and passes ``local_size=config.sliding_window``; the one other ``and_masks`` pattern
    given a ``local_size``, chunked attention, passes ``config.attention_chunk_size`` (a config with both set to
    the same size is left to the dense path), and non-causal configs build bidirectional windows.
    """
    if local_size is None or config is None or not _same_code(mask_function, masking_utils.and_masks()):
        return None
    if local_size != getattr(config, "sliding_window", None) or not getattr(config, "is_causal", True):
        return None
    if getattr(config, "attention_chunk_size", None) == local_size:
        return None
    return MaskPattern(causal=True, sliding_window=int(local_size))


def _and_mask_parts(mask_function: Callable) -> tuple[Callable, ...] | None:
    if not _same_code(mask_function, masking_utils.and_masks()):
        return None
    parts = _closure_value(mask_function, "mask_functions")
    return tuple(parts) if isinstance(parts, tuple) else None


_NO_CODE = object()


def _same_code(fn: Callable, other: Callable) -> bool:
    return getattr(fn, "__code__", None) is getattr(other, "__code__", _NO_CODE)


def _closure_value(fn: Callable, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def pipeline_generation_config(pipe, generate_kwargs: dict):
    """(effective GenerationConfig, generate() kwargs it does not hold) of a text-generation pipeline call.

    transformers 5.24 prepares a call's kwargs with ``Pipeline._prepare_generate_kwargs``; 5.17 passes the
    pipeline's own ``generation_config`` unless the call gives one (that branch goes at a floor that has it).
    """
    import copy

    kwargs = dict(generate_kwargs)
    if hasattr(pipe, "_prepare_generate_kwargs"):
        kwargs = pipe._prepare_generate_kwargs(kwargs)
        base = kwargs.pop("generation_config", None) or pipe.model.generation_config
    else:
        base = kwargs.pop("generation_config", None) or pipe.generation_config
    config = copy.deepcopy(base)
    unused = config.update(**kwargs)
    return config, unused


# The fastest settings of transformers' continuous batching on CUDA, where the installed release has them: CUDA
# graphs for prefill and decode, asynchronous double-buffered batching, and compile level 1 (mode "default",
# dynamic; levels 2-3 add max-autotune, whose warm-up takes minutes per shape)
_FAST_CONTINUOUS_BATCHING = {"use_cuda_graph": True, "use_async_batching": True, "default_compile_level": 1}


def continuous_batching_config(num_blocks: int, block_size: int, max_batch_tokens: int, *, fastest: bool = False):
    """``(config, description)``: transformers' ``ContinuousBatchingConfig`` sized explicitly (its block-size
    argument was renamed ``page_size`` after 5.17: delete ``block_size`` at a later floor) and, with ``fastest`` (on
    CUDA), its fastest settings that the installed release offers; the description names the settings used."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = inspect.signature(ContinuousBatchingConfig).parameters
    size_name = "page_size" if "page_size" in fields else "block_size"
    extra = {name: value for name, value in _FAST_CONTINUOUS_BATCHING.items() if fastest and name in fields}
    config = ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **{size_name: block_size}, **extra
    )
    description = ", ".join(f"{name}={value}" for name, value in extra.items()) or "defaults"
    return config, description


# generate() options that change which tokens (or what kind of output) come out, each with the value that means
# "off" (None always means off too). A path that serves generate() calls itself (speculative decoding, the
# engine behind pipeline()) names the ones it implements; any other that is on sends the call to transformers.
_GENERATION_OPTIONS: dict[str, object] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "min_length": 0,
    "min_p": 0.0,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "penalty_alpha": None,
    "dola_layers": None,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "renormalize_logits": False,
    "exponential_decay_length_penalty": None,
    "max_time": None,
    "stop_strings": None,
    "token_healing": False,
    "cache_implementation": None,
    "prompt_lookup_num_tokens": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
}


def generation_options() -> dict[str, object]:
    """The token-changing generate() options of the installed transformers release, with their "off" values."""
    from transformers import GenerationConfig

    fields = GenerationConfig()
    return {name: off for name, off in _GENERATION_OPTIONS.items() if hasattr(fields, name)}


def active_generation_options(config, kwargs: dict, implemented: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The options a generate() call turns on (``kwargs`` over the generation ``config``) that are not in
    ``implemented``, sorted by name."""
    active = []
    for name, off in generation_options().items():
        value = kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)
        if name not in implemented and value is not None and value != off:
            active.append(name)
    return sorted(active)


def custom_generate_kwargs(kwargs: dict, config) -> tuple[dict, object]:
    """``(kwargs, streamer)``: a ``generate()`` call's keyword arguments for a *callable* ``custom_generate``, keeping
    what transformers (5.17 to 5.2x) drops on that route — ``_extract_generation_mode_kwargs`` then forwards only
    the callable's own extra parameters, so neither the streamer nor the tokenizer (which the stop-string
    criterion needs) arrives. The streamer is taken out and returned, for the callable to bind (it puts the
    prompt, as generate would have); stop strings become transformers' own ``StopStringCriteria`` in
    ``stopping_criteria``. Without a tokenizer, stop strings stay, and generate raises its own error."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    kwargs = dict(kwargs)
    streamer = kwargs.pop("streamer", None)
    stop_strings = kwargs.get("stop_strings")
    if stop_strings is None:
        stop_strings = getattr(config, "stop_strings", None)
    tokenizer = kwargs.get("tokenizer")
    if stop_strings and tokenizer is not None:
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs.update(stopping_criteria=criteria, stop_strings=None)
    return kwargs, streamer


def transformers_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """transformers' own greedy / multinomial decoding loop (``GenerationMixin._sample``), for calls hfaccel's loop
    hands back from inside ``generate``."""
    from transformers.generation.utils import GenerationMixin

    return GenerationMixin._sample(
        model,
        input_ids,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        **kwargs,
    )


def transformers_prefill(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict):
    """transformers' own prefill of a ``generate`` call (``GenerationMixin._prefill``, private; the same signature
    from 5.17 to 5.24): the model's forward over the prompt with the inputs ``prepare_inputs_for_generation`` makes of
    ``model_kwargs`` — a multimodal model's images encoded and merged as its generate() does. Returns its outputs."""
    return model._prefill(input_ids, generation_config, model_kwargs)


def generation_position_ids(model, input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor | None:
    """The position ids ``generate`` gives the forward for the prompt ``input_ids [1, N]``
    (``GenerationMixin._prepare_position_ids_for_generation``, private: an M-RoPE model's ``[4, 1, N]``, the text
    positions then its three axes, computed from the processor's inputs in ``model_kwargs``), or None where the
    forward takes none."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    return model._prepare_position_ids_for_generation(input_ids, dict(model_kwargs))


def continues_multimodal_prompts(model) -> bool:
    """Whether the model's forward continues a prompt with images after tokens its cache holds, given the inputs of
    :func:`prefill_chunk_inputs`: where transformers' own chunked prefill does (5.24 on, which takes pre-encoded
    images; 5.17 gives Gemma 3 the chunk's token types alone, which its bidirectional mask reads by position)."""
    return takes_encoded_media(model)


def prefill_chunk_inputs(model, input_ids: torch.Tensor, cache, model_kwargs: dict) -> dict:
    """The forward's inputs for ``input_ids [1, L]``, a prompt's tokens after those ``cache`` holds, as transformers'
    chunked prefill makes them (``GenerationMixin._prefill``, 5.24 on: the model's ``prepare_inputs_for_generation``
    of the chunk in the first iteration; ``model_kwargs`` the whole prompt's attention mask and token types, the
    chunk's position ids, its images' inputs)."""
    kwargs = dict(model_kwargs)
    encoded = kwargs.pop("mm_encoder_outputs", None)  # added after, as transformers does: preparing may drop it
    inputs = model.prepare_inputs_for_generation(
        input_ids, is_first_iteration=True, **{cache_argument(model): cache}, **kwargs
    )
    if encoded is not None:
        inputs["mm_encoder_outputs"] = encoded
    return inputs


def takes_encoded_media(model) -> bool:
    """Whether the model's forward takes images encoded beforehand (``mm_encoder_outputs``: transformers >= 5.24)."""
    supports = getattr(model, "_supports_mm_encoder_outputs", None)
    return supports is not None and supports()


def encode_media(model, inputs: dict) -> dict | None:
    """A prompt's images (videos) encoded as ``generate`` encodes them before its prefill — the model's
    ``mm_encoder_outputs`` (``GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation``, private) — or None
    where the model cannot take them (:func:`takes_encoded_media`; 5.17: the forward encodes its pixels)."""
    if not takes_encoded_media(model):
        return None
    return model._prepare_multimodal_encoder_kwargs_for_generation(dict(inputs)).get("mm_encoder_outputs") or None


def slice_encoded_media(output, rows: torch.Tensor):
    """The rows ``rows`` of an encoder output's features (``mm_encoder_outputs[modality]``), flattened to one per
    placeholder token, in the container the model reads pre-encoded features from — transformers' own slicing for
    chunked prefill (``generation.utils._slice_mm_encoder_output``, private, 5.24 on) — or None where it has none
    (5.17)."""
    from transformers.generation import utils

    slicer = getattr(utils, "_slice_mm_encoder_output", None)
    return None if slicer is None else slicer(output, rows)


def join_encoded_media(outputs: Sequence):
    """Encoder outputs of one modality (each image's, :func:`encode_media`) as one, their rows in order, in the
    container the first is in (the pooled features, and deepstack ones where the model has them), as
    :func:`slice_encoded_media` keeps them."""
    first = outputs[0]
    joined = {"pooler_output": _joined_features([output["pooler_output"] for output in outputs])}
    deepstack = first.get("deepstack_features")
    if deepstack is not None:
        joined["deepstack_features"] = [
            _joined_features([output["deepstack_features"][layer] for output in outputs])
            for layer in range(len(deepstack))
        ]
    return type(first)(**joined)


def _joined_features(features: Sequence):
    """Features of several outputs (each a list of tensors, or a tensor), flattened to a row per placeholder token and
    concatenated, in the first's container: ``[[rows, hidden]]`` or ``[1, rows, hidden]``."""
    rows = torch.cat([item.reshape(-1, item.shape[-1]) for feature in features for item in feature])
    return rows[None] if isinstance(features[0], torch.Tensor) else [rows]


def encoded_rows(output) -> int:
    """How many placeholder tokens an encoder output's features fill (its pooled features, one row per token)."""
    return sum(feature.reshape(-1, feature.shape[-1]).shape[0] for feature in output["pooler_output"])


def generation_pad_tensor(generation_config) -> torch.Tensor | None:
    """The pad token ``generate`` prepared for finished rows (a tensor on the inputs' device, or None)."""
    return generation_config._pad_token_tensor


# ---- transformers' static cache + compile on any device: ``CompileConfig._compile_all_devices`` (private; otherwise
# generate() compiles its forward on cuda / xpu only) ----
def compile_config_on_every_device():
    """A ``CompileConfig`` under which ``generate()`` with a static cache compiles its decode forward on whatever
    device the model is on (the CPU included): fullgraph, static shapes, inductor's default mode (its
    "reduce-overhead" adds CUDA graphs, which a CPU has not)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config


# ---- tensor parallelism: a model loaded with ``tp_plan="auto"`` (``DistributedConfig`` from 5.18; tp_group's
# 1-D mesh branch is 5.17's, deleted at a 5.18 floor) ----
# Colwise plans of these projections split the attention's KV heads across the ranks (transformers' own list, in
# ``get_kv_heads_per_rank`` from 5.24).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def tp_size(model) -> int:
    """The model's tensor-parallel degree: 1 for a model transformers did not shard (``model.tp_size`` is None)."""
    return int(getattr(model, "_tp_size", None) or 1)


def tp_plan(model) -> dict[str, str]:
    """The plan transformers sharded the model with (module name pattern -> style); empty if not sharded."""
    return dict(getattr(model, "tp_plan", None) or {}) if tp_size(model) > 1 else {}


def tp_group(model):
    """The ``torch.distributed`` process group of the model's tensor-parallel ranks (None when not sharded).
    transformers 5.17 keeps a 1-D mesh of the TP ranks; later releases a ``(pp, fsdp, tp)`` mesh."""
    mesh = getattr(model, "_device_mesh", None)
    if tp_size(model) == 1 or mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    return mesh.get_group("tp") if mesh.ndim > 1 or "tp" in names else mesh.get_group()


def tp_splits_kv_heads(model) -> bool:
    """Whether the model's TP plan splits the KV heads across the ranks (a colwise key projection)."""
    return any(
        key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style == "colwise" for key, style in tp_plan(model).items()
    )


def tp_style(model, module_name: str) -> str | None:
    """The TP plan's style for the submodule ``module_name`` (``"colwise"``, ``"rowwise"``, ...; plan keys name
    layers with ``*`` for the layer number), or None where the plan leaves it whole on every rank."""
    for pattern, style in tp_plan(model).items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def device_map_devices(model) -> set[str]:
    """The devices ``from_pretrained(device_map=...)`` spread the model over (empty without a device map)."""
    return {str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()}
