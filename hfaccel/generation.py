"""``generate`` of an accelerated model: a PagedCache sized for each request unless the caller chose a cache."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from hfaccel.cache import PagedCache
from hfaccel.speculative import generate_arguments, speculative_generate


def install_paged_generate(model) -> None:
    """Give this model instance a ``generate`` that supplies a PagedCache (``restore`` removes it)."""
    generate = type(model).generate.__get__(model)

    @functools.wraps(generate)
    def paged_generate(*args, **kwargs):
        return generate_with_paged_cache(model, generate, args, kwargs)

    model.generate = paged_generate


def uninstall_paged_generate(model) -> None:
    model.__dict__.pop("generate", None)


def generate_with_paged_cache(model, generate: Callable, args: tuple, kwargs: dict):
    """Call ``generate`` with a fresh PagedCache for the request, or validate the caller's PagedCache first.

    Left to transformers' own cache choice: an explicit ``past_key_values`` that is not a PagedCache, a
    ``cache_implementation`` (argument or generation config), or a request whose size cannot be read.
    """
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        return _assisted_generate(model, generate, args, kwargs)
    cache = kwargs.get("past_key_values")
    shape = request_shape(model, args, kwargs)
    if isinstance(cache, PagedCache):
        if shape is not None:
            cache.check_request(*shape)  # before any forward pass; the cache stays usable
        return generate(*args, **kwargs)
    if cache is not None or shape is None or _cache_implementation(model, kwargs) is not None:
        return generate(*args, **kwargs)
    rows, total_len = shape
    kwargs["past_key_values"] = PagedCache(model.config, max_batch_size=rows, max_cache_len=total_len)
    return generate(*args, **kwargs)


def _assisted_generate(model, generate: Callable, args: tuple, kwargs: dict):
    """Assisted decoding through hfaccel's batched speculative decoding, or transformers' own (with a warning
    that names why) for options hfaccel does not implement."""
    arguments = generate_arguments(model, args, kwargs)
    if isinstance(arguments, str):
        warnings.warn(f"hfaccel: assisted generation runs on transformers' implementation (batch size 1 only) "
                      f"because of {arguments}", stacklevel=3)
        return generate(*args, **kwargs)
    return speculative_generate(model, **arguments)


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
