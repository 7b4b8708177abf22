"""The torch paths of hfaccel's attention: which dense calls SDPA computes exactly, the route a dense call takes
(SDPA or hfaccel's flash kernel, :func:`prefill_route`), and the exact torch attention over a dense mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfaccel.attention.masks import KernelMask, dense_mask
from hfaccel.attention.paths import FLASH, SDPA
from hfaccel.kernels.flash_attention import sdpa_preferred
from hfaccel.kernels.runtime import triton_can_run


def sdpa_computes(
    query: torch.Tensor, key: torch.Tensor, mask: KernelMask, softcap: float | None, sinks: torch.Tensor | None = None
) -> bool:
    """Whether ``F.scaled_dot_product_attention(..., is_causal=True)`` computes exactly this call: causal with the
    queries aligned to the keys (same count, same offset: SDPA's causal mask is top-left aligned), no key padding,
    no sliding window or chunk that hides a key, no softcap, no sinks."""
    window = mask.sliding_window
    return (
        mask.causal
        and mask.key_mask is None
        and softcap is None
        and sinks is None
        and (window is None or window >= key.shape[2])
        and _one_chunk(query, key, mask)
        and query.shape[2] == key.shape[2]
        and mask.q_offset == mask.kv_offset
    )


def prefill_route(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: KernelMask,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> str:
    """``"sdpa"`` or ``"hfaccel flash"``: the path of a dense call of the ``backend`` attention. Only ``auto`` routes:
    on a device where hfaccel's kernels do not run (the CPU without the Triton interpreter, MPS), every call to SDPA
    (:func:`sdpa_dense`); on CUDA, only 16-bit calls that SDPA computes exactly as they are, and only where the GPU's
    tuned table says SDPA is the faster (or has no measurement: ``hfaccel.kernels.flash_attention.sdpa_preferred``).
    Host-side: shapes, dtype and one table lookup; inside a ``torch.compile`` trace, which cannot read the table,
    SDPA."""
    if backend == "auto" and not triton_can_run(query.device):
        return SDPA
    if not (
        backend == "auto"
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and sdpa_computes(query, key, mask, softcap, sinks)
    ):
        return FLASH
    if torch.compiler.is_compiling():  # a trace cannot read the table (a file); what the table says without an entry
        return SDPA
    return (
        SDPA
        if sdpa_preferred(query.shape[-1], query.shape[1] // key.shape[1], query.shape[2], query.dtype, query.device)
        else FLASH
    )


def sees_every_key(query: torch.Tensor, key: torch.Tensor, mask: KernelMask) -> bool:
    """Whether every query of this call sees every key (no padding, no window or chunk hiding a key, causal or not,
    the first query at or past the last key): SDPA with no mask computes it exactly (a decode step)."""
    last_key = mask.kv_offset + key.shape[2] - 1
    window = mask.sliding_window
    return (
        mask.key_mask is None
        and (not mask.causal or mask.q_offset >= last_key)
        and (window is None or mask.q_offset + query.shape[2] - 1 - mask.kv_offset < window)
        and _one_chunk(query, key, mask)
    )


def _one_chunk(query: torch.Tensor, key: torch.Tensor, mask: KernelMask) -> bool:
    """Whether the call's first key and last query share one chunk (no chunk hides a key), or there are none."""
    chunk = mask.chunk_size
    last_query = mask.q_offset + query.shape[2] - 1
    return chunk is None or mask.kv_offset // chunk == last_query // chunk


def sdpa_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: KernelMask,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The SDPA route (:func:`prefill_route`) as transformers' ``sdpa`` computes attention: ``is_causal`` when the
    queries align with the keys, no mask when every query sees every key, else the dense mask (softcap, sinks: the
    exact torch formula). ``[B, Sq, Hq, D]``."""
    if sdpa_computes(query, key, mask, softcap, sinks):
        return sdpa_causal(query, key, value, scaling)
    dense = None if softcap is None and sees_every_key(query, key, mask) else dense_mask(mask, query, key)
    return dense_attention(query, key, value, dense, scaling, softcap, sinks, 0.0)


def sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """The SDPA route: ``query [B, Hq, S, D]`` over ``key, value [B, Hkv, S, D]`` (aligned, causal) ->
    ``[B, S, Hq, D]``, GQA without repeating K/V."""
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=True,
        scale=softmax_scale(scaling, query),
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def softmax_scale(scaling: float | None, query: torch.Tensor) -> float:
    """The scale a call passes, else transformers' default ``1 / sqrt(head_dim)``."""
    return query.shape[-1] ** -0.5 if scaling is None else float(scaling)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Exact torch attention with a dense mask ``[B, 1|Hq, Sq, Skv]`` (bool: True = attend; float: additive; None:
    every query sees every key), softcapped logits and sinks ``[Hq]`` (one more logit per query head, as
    transformers' eager attention appends it)."""
    group = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=group > 1
        )
        return out.transpose(1, 2).contiguous()
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-1, -2) * scale  # [B, Hq, Sq, Skv]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None and mask.dtype == torch.bool:  # the lowest value, as transformers' eager: a query that sees
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # no key (padding) gets no NaN
    elif mask is not None:
        scores = scores + mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], -1)
    probs = torch.softmax(scores.float(), -1)[..., : key.shape[2]]
    probs = F.dropout(probs.to(value.dtype), p=dropout, training=dropout > 0)
    return (probs @ value).transpose(1, 2).contiguous()
