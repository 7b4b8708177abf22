"""``generate`` of an accelerated model.

- Greedy and sampled decoding (every logits processor and stopping criterion transformers builds) run hfaccel's
  decode loop (``hf/decode.py``): packed prefill, compiled and captured decode steps, no host sync per step.
- Assisted generation (``assistant_model`` / ``prompt_lookup_num_tokens``) runs hfaccel's speculative decoding.
- Anything else (beam search, a cache the caller chose, outputs beyond the token ids...) runs transformers' own
  loop, with a :class:`PagedCache` sized for the request unless the caller chose a cache.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable

import torch

from hfaccel import compat
from hfaccel.device import model_device
from hfaccel.hf.adapters import LoraState
from hfaccel.hf.decode import hfaccel_sample, left_padding
from hfaccel.hf.structured import refuse_assisted
from hfaccel.kernels.runtime import resolve_backend
from hfaccel.kv import PagedCache, local_kv_heads
from hfaccel.kv.fp8 import model_kv_scales
from hfaccel.kv.layout import kv_dims, model_layout, own_cache_class
from hfaccel.runner.graphs import context_bucket
from hfaccel.runner.step_function import failure_reason
from hfaccel.sampling import token_ids

_log = logging.getLogger("hfaccel")
MIN_STATIC_CACHE_LEN = 256  # a compiled static-cache forward specializes on its length: few lengths, few recompiles

# token-changing generate() options hfaccel's decode loop leaves to transformers (it serves every other one, with
# transformers' own processors and criteria)
_LOOP_LEAVES = frozenset(
    {
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "constraints",
        "force_words_ids",
        "penalty_alpha",
        "dola_layers",
        "guidance_scale",
        "cache_implementation",
        "prompt_lookup_num_tokens",
        "return_dict_in_generate",
        "output_scores",
        "output_logits",
        "output_attentions",
        "output_hidden_states",
    }
)
# generate() arguments that change how it runs and that the loop leaves to transformers
_LOOP_LEAVES_ARGS = (
    "custom_generate",
    "synced_gpus",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "inputs_embeds",
)


def install_generate(model) -> None:
    """Give this model instance hfaccel's ``generate`` (``restore`` removes it)."""
    generate = type(model).generate.__get__(model)

    @functools.wraps(generate)
    def accelerated_generate(*args, **kwargs):
        return generate_accelerated(model, generate, args, kwargs)

    model.generate = accelerated_generate


def uninstall_generate(model) -> None:
    model.__dict__.pop("generate", None)


def generate_accelerated(model, generate: Callable, args: tuple, kwargs: dict):
    """Route one ``generate`` call (module docstring). transformers' loop gets a fresh PagedCache sized for the
    request, or the caller's PagedCache checked against the request first; it keeps its own cache choice for an
    explicit cache (``cache=`` or ``past_key_values=``) of another kind, a ``cache_implementation``, or a request
    whose size cannot be read."""
    session = model.hfaccel.session
    adapters = _read_adapters(model, session)
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        refuse_assisted(kwargs)
        if adapters is not None:
            session.served_by_transformers(adapters)
            return generate(*args, **kwargs)
        return _assisted_generate(model, generate, args, kwargs)
    faster = _transformers_is_faster(model)
    if faster is not None:
        return _generate_where_transformers_is_faster(model, generate, args, kwargs, faster)
    cache = compat.given_cache(kwargs)
    shape = request_shape(model, args, kwargs)
    reason = adapters or _loop_leaves(model, kwargs, cache, shape)
    if reason is None:
        config = kwargs.get("generation_config") or model.generation_config
        kwargs, streamer = compat.custom_generate_kwargs(kwargs, config)
        return generate(*args, custom_generate=functools.partial(hfaccel_sample, streamer=streamer), **kwargs)
    session.served_by_transformers(reason)
    if isinstance(cache, PagedCache):
        if shape is not None:
            _tell_padding(cache, kwargs.get("attention_mask"), shape[0])
            cache.check_request(*shape)  # before any forward pass; the cache stays usable
        return generate(*args, **kwargs)
    if (
        cache is not None
        or shape is None
        or _cache_implementation(model, kwargs) is not None
        or not _paged_cache_holds(model)
    ):
        return generate(*args, **kwargs)
    rows, total_len = shape
    kwargs[compat.generate_cache_argument()] = PagedCache(
        model.config,
        max_batch_size=rows,
        max_cache_len=total_len,
        num_kv_heads=local_kv_heads(model),
        left_padding=_left_padding(kwargs.get("attention_mask"), rows),
        **_fp8_storage(model, session),
    )
    return generate(*args, **kwargs)


def _fp8_storage(model, session) -> dict:
    """``PagedCache``'s ``dtype`` and ``kv_scales`` for a session whose pools are fp8 (the model's checkpoint scales
    unless others were given); nothing otherwise."""
    if session.kv_cache_dtype is None:
        return {}
    scales = session.kv_scales if session.kv_scales is not None else model_kv_scales(model) or None
    return {"dtype": session.kv_cache_dtype, "kv_scales": scales}


def _paged_cache_holds(model) -> bool:
    """Whether a ``PagedCache`` made from the config holds what the model's layers keep: K/V of the config's one
    shape in each of its layers, no recurrent state and no cache class of the model's own (else transformers' loop
    keeps its own cache: Gemma 4's per-layer heads and shared layers, MLA's latents, hybrid models, MiniMax, Dory's
    cache layers for its loops)."""
    layout = model_layout(model)
    shapes = {(kv.kv_heads, kv.key_dim, kv.value_dim, kv.latent) for kv in layout.attention.values()}
    if layout.states or len(layout.attention) != layout.num_layers or len(shapes) != 1 or own_cache_class(model):
        return False
    layers, _, head_dim = kv_dims(model.config)  # a config of one shape (per-layer ones have several)
    return layout.num_layers == layers and shapes == {(local_kv_heads(model), head_dim, head_dim, False)}


def _read_adapters(model, session) -> str | None:
    """Tell the session the adapter state of a PEFT model's LoRA layers for this call (its decode steps are kept per
    state); returns why transformers' loop must serve the call, or None. Layers PEFT injected after ``accelerate``
    (``get_peft_model`` on an accelerated model) count too; nothing is read while peft is not even imported."""
    lora = model.hfaccel.lora
    if lora is None:
        if not compat.peft_loaded():
            return None
        lora = LoraState(model)
    session.adapters, reason = lora.call_state()
    return reason


def _transformers_is_faster(model) -> str | None:
    """Why transformers' own loop and cache serve this model's calls as the faster path, or None. Where hfaccel's
    kernels do not run (the CPU without Triton, MPS), ``auto`` attention is transformers' SDPA and transformers'
    loop over its DynamicCache was measured faster than hfaccel's decode loop over the paged pool (SmolLM2-135M fp32
    on a 2-core CPU: 0.78x at batch 1, 0.81x at a padded batch of 4; hfaccel's compiled step, 0.49x, where
    transformers' static cache + compiled forward gives 1.04-1.12x: :func:`_compiled_static_cache`), so it serves
    them; the ``torch`` backend keeps hfaccel's loop (the reference kernels, for checking), as does an fp8 KV cache
    (only hfaccel's pools hold one)."""
    device = model_device(model)
    if model.hfaccel.attention != "auto" or resolve_backend("auto", device) != "torch":
        return None
    if model.hfaccel.session.kv_cache_dtype is not None:
        return None  # the fp8 pool asked for is hfaccel's
    return f"the faster path on {device.type}, where hfaccel's kernels do not run (its attention: transformers' sdpa)"


def _generate_where_transformers_is_faster(model, generate: Callable, args: tuple, kwargs: dict, reason: str):
    """transformers' loop, as the faster path here (``reason``); with ``compile=True`` over its static cache and
    compiled decode forward (:func:`_compiled_static_cache`). A compile failure runs the call again eagerly, and
    later calls eagerly, with its reason in ``model.hfaccel.decode`` and one warning."""
    session = model.hfaccel.session
    compiled = _compiled_static_cache(model, args, kwargs)
    if compiled is not None:
        session.served_by_transformers_by_choice(f"{reason}; compile=True: its static cache and compiled forward")
        try:
            return generate(*args, **compiled)
        except compat.compile_errors() as error:
            session.static_compile_failure = failure_reason(error)
            _log.warning(
                "hfaccel: torch.compile could not compile %s's forward (%s); generate() runs it uncompiled",
                type(model).__name__,
                session.static_compile_failure,
            )
    if session.static_compile_failure:
        reason += f"; compile=True could not compile ({session.static_compile_failure})"
    session.served_by_transformers_by_choice(reason)
    return generate(*args, **kwargs)


def _compiled_static_cache(model, args: tuple, kwargs: dict) -> dict | None:
    """With ``compile=True`` where transformers' loop is the faster path: ``kwargs`` asking for transformers' own
    static cache and compiled decode forward (``cache_implementation="static"`` + compile, on every device), the
    cache sized for the power of two that holds the request (>= 256 tokens; the caller's ``max_cache_len`` if
    larger), so that most longer requests reuse the cache and its compiled graph; None when the caller chose a
    cache, a cache implementation, a compile config or ``disable_compile``, streams (a failed compile could not be
    taken back), or compiling failed before. ``hfaccel demo --device cpu --compile true`` on a 2-core CPU
    (SmolLM2-135M fp32): 1.04-1.12x eager transformers at batch 1 to 4, the same text, after a first call that
    compiles (~40 s; docs/benchmarks.md); a new batch size or a request past the cache compiles again."""
    config = kwargs.get("generation_config") or model.generation_config
    chosen = (
        compat.given_cache(kwargs),
        _cache_implementation(model, kwargs),
        kwargs.get("streamer"),
        kwargs.get("compile_config", getattr(config, "compile_config", None)),
    )
    disabled = kwargs.get("disable_compile", getattr(config, "disable_compile", None))
    if (
        model.hfaccel.compile is not True
        or model.hfaccel.session.static_compile_failure
        or disabled
        or any(choice is not None for choice in chosen)
    ):
        return None
    compiled = {**kwargs, "cache_implementation": "static", "compile_config": compat.compile_config_on_every_device()}
    shape = request_shape(model, args, kwargs)
    if shape is not None:
        wanted = kwargs.get("max_cache_len", getattr(config, "max_cache_len", None)) or 0
        bucket = context_bucket(shape[1], whole=False, model=model, floor=MIN_STATIC_CACHE_LEN)
        compiled["max_cache_len"] = max(wanted, bucket)
    return compiled


def _tell_padding(cache: PagedCache, mask: torch.Tensor | None, rows: int) -> None:
    """Give a fresh caller's PagedCache this batch's left padding (with hfaccel's attention it then holds no slot
    for it)."""
    pads = _left_padding(mask, rows)
    if not cache.rows and pads is not None:
        cache.set_left_padding(pads)


def _left_padding(mask: torch.Tensor | None, rows: int) -> list[int] | None:
    """Each cache row's left padding (prompt rows repeated as generate expands them for beams or return
    sequences), or None when the mask is not plain left padding."""
    pads = left_padding(mask) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    if pads is None or rows % len(pads):
        return None
    return [pad for pad in pads for _ in range(rows // len(pads))]


def _loop_leaves(model, kwargs: dict, cache, shape) -> str | None:
    """Why hfaccel's decode loop leaves this call to transformers' loop, or None when it serves it."""
    if cache is not None:
        return "the caller's cache"
    if shape is None:
        return "inputs other than a [batch, length] tensor of token ids"
    given = sorted(name for name in _LOOP_LEAVES_ARGS if kwargs.get(name) is not None)
    if given:
        return f"generate() arguments {given}"
    config = kwargs.get("generation_config") or model.generation_config
    implemented = set(compat.generation_options()) - _LOOP_LEAVES
    active = compat.active_generation_options(config, kwargs, implemented)
    return f"generation options {active}" if active else None


def _assisted_generate(model, generate: Callable, args: tuple, kwargs: dict):
    """Assisted decoding through hfaccel's batched speculative decoding, or transformers' own (with a warning
    that names why) for options hfaccel does not implement."""
    from hfaccel.speculative import SpeculativeRunners, speculative_generate  # only a call that asks loads it

    arguments = generate_arguments(model, args, kwargs)
    if isinstance(arguments, str):
        warnings.warn(
            f"hfaccel: assisted generation runs on transformers' implementation (batch size 1 only) "
            f"because of {arguments}",
            stacklevel=3,
        )
        return generate(*args, **kwargs)
    session = model.hfaccel.session
    runners = None
    if session is not None:  # the runners (compiled and captured steps) stay for the next call
        runners = session.speculative_runners(lambda: SpeculativeRunners(**session.pool_options()))
    return speculative_generate(model, compile=model.hfaccel.compile, runners=runners, **arguments)


def request_shape(model, args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(rows, tokens per row) a generate() call will hold in its cache, or None if it cannot be told."""
    inputs = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if inputs is None:
        inputs = kwargs.get("inputs_embeds", kwargs.get("inputs"))
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return None
    config = kwargs.get("generation_config") or model.generation_config
    prompt_len = inputs.shape[1]
    new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new_tokens is None:
        new_tokens = kwargs.get("max_length", config.max_length) - prompt_len
    beams = kwargs.get("num_beams", config.num_beams) or 1
    returns = kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    return inputs.shape[0] * (beams if beams > 1 else returns), prompt_len + max(int(new_tokens), 1)


def _cache_implementation(model, kwargs: dict) -> str | None:
    config = kwargs.get("generation_config") or model.generation_config
    return kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))


# generate() arguments the speculative route reads (the token-changing options are compat.generation_options())
_SPECULATIVE_ARGS = {
    "input_ids",
    "inputs",
    "attention_mask",
    "generation_config",
    "assistant_model",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "eos_token_id",
    "pad_token_id",
    "stop_strings",
    "tokenizer",
    "assistant_tokenizer",
    "use_cache",
    "seed",
}
_SPECULATIVE_IMPLEMENTS = frozenset({"stop_strings", "prompt_lookup_num_tokens"})


def generate_arguments(model, args: tuple, kwargs: dict) -> dict | str:
    """``speculative_generate`` keyword arguments for a ``model.generate(...)`` call that asks for assisted
    decoding (``assistant_model`` or ``prompt_lookup_num_tokens``), or the reason it must stay transformers'."""
    kwargs = dict(kwargs)
    if args:
        if len(args) > 1 or not isinstance(args[0], torch.Tensor):
            return "positional arguments other than the input ids"
        kwargs["input_ids"] = args[0]
    known = _SPECULATIVE_ARGS | set(compat.generation_options())
    unknown = sorted(k for k, v in kwargs.items() if k not in known and v is not None)
    if unknown:
        return f"generate() arguments {unknown}"
    config = kwargs.pop("generation_config", None) or model.generation_config
    active = compat.active_generation_options(config, kwargs, _SPECULATIVE_IMPLEMENTS)
    if active:
        return f"generation options {active}"
    value = lambda name: kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)  # noqa: E731
    assistant, tokenizer = kwargs.get("assistant_model"), kwargs.get("tokenizer")
    if kwargs.get("assistant_tokenizer") is not None:
        return "a different assistant tokenizer (universal assisted decoding)"
    if any(model_layout(m).hybrid for m in (model, assistant) if m is not None):
        return "a model whose layers keep recurrent state (hfaccel's speculative decoding cannot roll it back)"
    ngram = assistant is None
    input_ids = kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "inputs other than a [batch, length] tensor of token ids"
    steps = value("prompt_lookup_num_tokens") if ngram else value("num_assistant_tokens")
    max_new = value("max_new_tokens")
    return {
        "draft_model": assistant,
        "draft": "ngram" if ngram else "model",
        "input_ids": input_ids,
        "attention_mask": _generate_attention_mask(input_ids, kwargs.get("attention_mask"), config),
        "num_draft_tokens": int(steps) if steps else 4,
        "ngram_size": int(value("max_matching_ngram_size") or 2),
        "max_new_tokens": int(max_new) if max_new is not None else int(value("max_length")) - input_ids.shape[1],
        "do_sample": bool(value("do_sample")),
        "temperature": float(value("temperature") or 1.0),
        "top_p": float(value("top_p") or 1.0),
        "top_k": value("top_k"),
        "eos_token_id": value("eos_token_id"),
        "pad_token_id": value("pad_token_id"),
        "stop_strings": value("stop_strings"),
        "tokenizer": tokenizer,
        "seed": kwargs.get("seed"),
    }


def _generate_attention_mask(input_ids: torch.Tensor, mask: torch.Tensor | None, config) -> torch.Tensor | None:
    """The attention mask ``generate`` would infer: padding where ``pad_token_id`` (not also EOS) appears."""
    if mask is not None or config.pad_token_id is None:
        return mask
    if config.pad_token_id in token_ids(config.eos_token_id) or not (input_ids == config.pad_token_id).any():
        return None
    return (input_ids != config.pad_token_id).long()
