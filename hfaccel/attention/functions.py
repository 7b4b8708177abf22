"""hfaccel's attention functions, as transformers' ``AttentionInterface`` sees them, and the mask function each
backend pairs with (``hfaccel.attention.masks``).

The mask function turns transformers' mask request into a :class:`~hfaccel.attention.masks.KernelMask`; the
attention function hands it to :func:`hfaccel.kernels.flash_attention`. Whatever the kernels do not implement (an
unrecognised mask pattern, dropout while training, autograd) is served by an exact torch path instead, never
approximated.

Routing: a plain causal prefill (queries aligned to the keys, no padding, no window that hides a key, no
softcap) is exactly what torch SDPA computes; the ``auto`` backend sends it to SDPA (cuDNN / flash) on CUDA
when the GPU's tuned table measured SDPA faster for the shape (:func:`~hfaccel.attention.sdpa.prefill_route`).
Everything SDPA cannot express stays on hfaccel's kernels. On a device where hfaccel's kernels do not run (the CPU,
MPS), ``auto`` serves every dense call by SDPA as transformers' ``sdpa`` does
(:func:`~hfaccel.attention.sdpa.sdpa_dense`; the torch reference kernels are for checking, the ``torch`` backend),
and paged calls by the batched torch paged attention. Which path served each eager call is counted in the model's
:class:`~hfaccel.attention.paths.AttentionPaths` (``model.hfaccel.attention_paths``): a host-side decision, no
device sync.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from hfaccel import compat
from hfaccel.attention.masks import PACKED_MASK, KernelMask, auto_mask, dense_mask, implicit_mask, kernel_mask
from hfaccel.attention.paths import ABSORBED, FLASH, PAGED, SDPA, SPARSE, TORCH, record_path
from hfaccel.attention.sdpa import dense_attention, prefill_route, sdpa_dense, softmax_scale
from hfaccel.kernels import flash_attention_reference
from hfaccel.kernels.ops import flash_attention_op, paged_attention_op
from hfaccel.kernels.runtime import interpreting
from hfaccel.kernels.ops import joined_rows
from hfaccel.kv.block_manager import slot_mapping
from hfaccel.kv.hf_cache import PACKED_STEP_KWARG, PAGED_READER_ATTRIBUTE, PagedKV, packed_sequences
from hfaccel.kv.indexer import sees
from hfaccel.kv.layout import widened
from hfaccel.kv.pool import PackedStep


def _attention(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, Sq, D]; key, value: [B, Hkv, Skv, D]; returns ([B, Sq, Hq, D], None)
    if kwargs.get("position_bias") is not None:  # never ignored: the scores would silently differ
        raise NotImplementedError(
            "an additive position bias (Inkling's relative logits) is not read by hfaccel's attention"
        )
    if not isinstance(key, PagedKV) and value.shape[-1] != key.shape[-1]:
        return _widened(backend, module, query, key, value, attention_mask, scaling, dropout, **kwargs), None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # s_aux: [Hq] attention sinks (gpt-oss)
    step = kwargs.get(PACKED_STEP_KWARG)
    if selects_keys(kwargs.get("indices"), key, step):
        record_path(module, SPARSE)
        return _sparse(module, query, key, value, attention_mask, scaling, softcap, sinks, dropout, step, kwargs), None
    if isinstance(key, PagedKV) and key.latent is not None:
        record_path(module, ABSORBED, backend, query)
        return _absorbed(backend, query, key, attention_mask, scaling, softcap, dropout), None
    if step is not None and not isinstance(key, PagedKV):
        record_path(module, PAGED, backend, query)
        return _expanded(backend, query, key, value, step, scaling, softcap, sinks, kwargs.get("sliding_window")), None
    if isinstance(key, PagedKV) and key.cu_seqlens_q is not None:
        query = _attention_temperature(module, query, key.positions)
        window = kwargs.get("sliding_window") or key.window  # the layer's window, passed or as its cache holds it
        if key.dense is None or not _paged_kernel_serves(attention_mask, dropout, query):
            record_path(module, PAGED, backend, query)
            return _packed(backend, query, key, attention_mask, scaling, softcap, sinks, dropout, window), None
        # one sequence's whole prompt: causal attention over its own new K/V, as any dense prefill
        attention_mask = replace(PACKED_MASK, sliding_window=window, chunk_size=key.chunk)
    if isinstance(key, PagedKV):
        if key.dense is None and _paged_kernel_serves(attention_mask, dropout, query):
            record_path(module, PAGED, backend, query)
            return _paged(backend, query, key, attention_mask, scaling, softcap, sinks), None
        key, value = key.gather()  # a prefill's own K/V, or a gather for what the paged kernel lacks
    if attention_mask is None:
        attention_mask = implicit_mask(module, query, key, kwargs)
    if not isinstance(attention_mask, KernelMask):
        record_path(module, TORCH)
        return dense_attention(query, key, value, attention_mask, scaling, softcap, sinks, dropout), None
    if dropout > 0.0:
        _warn_fallback("attention dropout is active (model in training mode)")
        record_path(module, TORCH)
        return dense_attention(
            query, key, value, dense_mask(attention_mask, query, key), scaling, softcap, sinks, dropout
        ), None
    mask = attention_mask
    if prefill_route(backend, query, key, mask, softcap, sinks) == SDPA:  # exact, and differentiable
        record_path(module, SDPA)
        return sdpa_dense(query, key, value, mask, scaling, softcap, sinks), None
    if _needs_autograd(query, key, value):  # differentiable
        record_path(module, TORCH)
        return flash_attention_reference(
            query,
            key,
            value,
            scale=scaling,
            causal=mask.causal,
            q_offset=mask.q_offset,
            kv_offset=mask.kv_offset,
            key_mask=mask.key_mask,
            sliding_window=mask.sliding_window,
            chunk_size=mask.chunk_size,
            softcap=softcap,
            sinks=sinks,
        ), None
    record_path(module, FLASH, backend, query)
    return flash_attention_op(
        query,
        key,
        value,
        mask.key_mask,
        softmax_scale(scaling, query),
        mask.causal,
        mask.q_offset,
        mask.kv_offset,
        mask.sliding_window,
        mask.chunk_size,
        softcap,
        sinks,
        backend,
    ), None


def _widened(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None,
    dropout: float,
    **kwargs,
) -> torch.Tensor:
    """Attention whose values are narrower or wider than its queries and keys (MLA's expanded K/V): all three
    zero-padded to the wider head, which leaves every score as it is, the output cut back to the values' width."""
    width = max(key.shape[-1], value.shape[-1])
    out, _ = _attention(
        backend,
        module,
        widened(query, width),
        widened(key, width),
        widened(value, width),
        attention_mask,
        softmax_scale(scaling, query),
        dropout,
        **kwargs,
    )
    return out[..., : value.shape[-1]]


def _expanded(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: PackedStep,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Packed queries over K/V their layer expanded from each sequence's latents (``PACKED_STEP_KWARG``):
    ``query [1, Hq, T, D]``, ``key, value [1, Hkv, S * L, D]`` (sequence ``s``'s from its first token at ``s * L``,
    ``L`` the step's ``max_seq_len``: ``SequenceKVCache._latents``) -> ``[1, T, Hq, D]``, by the paged kernel over
    the K/V as a pool of one block per sequence."""
    kv = torch.stack((key[0], value[0])).unflatten(2, (-1, step.max_seq_len))  # [2, Hkv, S, L, D]
    kv = kv.permute(0, 2, 3, 1, 4)[None]  # [1, 2, S, L, Hkv, D]
    tables = torch.arange(kv.shape[2], dtype=torch.int32, device=key.device)[:, None]  # [S, 1]
    return paged_attention_op(
        query,
        kv,
        0,
        tables,
        step.seq_lens,
        step.cu_seqlens_q,
        step.max_q_len,
        kv.shape[3],
        softmax_scale(scaling, query),
        None,
        sliding_window,
        None,
        softcap,
        sinks,
        backend,
    )


def _absorbed(
    backend: str,
    query: torch.Tensor,
    kv: PagedKV,
    mask,
    scaling: float | None,
    softcap: float | None,
    dropout: float,
    choice: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Packed queries ``[1, H, T, nope + rope]`` of a latent layer over its latents in the pool, in the latent space
    (``hfaccel.kv.latent``) -> ``[1, T, H, value]``: the query's ``nope`` part times ``W_UK``, the paged kernel over
    each token's two latents as one KV head of keys and values, the output's latent part times ``W_UV``. ``choice``:
    only the keys at pool slots ``[T, K]`` where ``[T, K]`` is True (a sparse-attention indexer's), by exact torch
    attention."""
    heads = kv.latent
    key_rows, value_rows = heads.split_weight()  # [H, nope, C], [H, value, C]
    q_nope, q_rope = query.split([heads.nope, query.shape[-1] - heads.nope], dim=-1)
    q_latent = torch.matmul(q_nope, key_rows)  # [1, H, T, C]
    joined = widened(torch.cat([q_latent, q_rope], dim=-1), 2 * kv.kv_cache.shape[-1])  # [1, H, T, 2 * width]
    scale = softmax_scale(scaling, query)
    if choice is None:
        out = _packed(backend, joined, kv, mask, scale, softcap, None, dropout, None, joined=True)  # [1, T, H, 2w]
    else:
        rows = joined_rows(kv.kv_cache[kv.layer]).flatten(0, 1)  # [num_slots, 1, 2 * width]
        out = gathered_attention(joined[0].transpose(0, 1), rows, rows, *choice, scale, softcap, None)[None]
    latent = out[..., : key_rows.shape[-1]].transpose(1, 2)  # [1, H, T, C]
    return torch.matmul(latent, value_rows.transpose(1, 2)).transpose(1, 2)  # [1, T, H, value]


def selects_keys(indices: torch.Tensor | None, key, step: PackedStep | None) -> bool:
    """Whether a sparse-attention indexer's choice ``indices [B, Sq, topk]`` leaves out keys some query sees: it
    chose fewer than the longest sequence holds (otherwise it chose every key each query sees, its mask the rest).
    A packed forward's (``step``; a latent layer's ``PagedKV`` comes with it), else transformers' ``key`` tensor."""
    if indices is None:
        return False
    return indices.shape[-1] < (step.max_seq_len if step is not None else key.shape[2])


def _sparse(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
    step: PackedStep | None,
    kwargs: dict,
) -> torch.Tensor:
    """Attention over the keys a sparse-attention indexer chose for each query (``kwargs["indices"]``) among those it
    sees, by exact torch attention: ``query [B, Hq, Sq, D]`` -> ``[B, Sq, Hq, D]``. A packed forward's choice
    (``step``) is each query's positions in its own sequence, ``[1, T, K]`` (-1: none; ``hfaccel.kv.indexer``), read
    from the pool's latent rows or from the K/V the layer expanded; transformers' is ``[B, Sq, K]`` into each row's
    keys (tensors: a sparse-attention layer's cache returns its latents)."""
    indices = kwargs["indices"]
    scale = softmax_scale(scaling, query)
    if step is None:  # transformers' layout: its mask, the chosen keys of each row
        visible = _dense_visibility(module, attention_mask, query, key, kwargs)  # [B, Sq, Skv]
        keep = visible & torch.zeros_like(visible).scatter_(-1, indices.long(), True)
        keep[..., 0] |= ~keep.any(-1)  # a padding query (it sees no key) reads one rather than none: no NaN
        return dense_attention(query, key, value, keep[:, None], scale, softcap, sinks, dropout)
    tokens = query.shape[2]
    sequence = packed_sequences(step.cu_seqlens_q, tokens)  # [T]
    positions = indices[0].long()  # [T, K]
    valid = sees(positions, step.positions[:, None], step.seq_lens[sequence][:, None])  # [T, K]
    positions = positions.clamp(min=0)
    if isinstance(key, PagedKV):  # a latent layer read in the latent space: the rows at the chosen slots
        slots = slot_mapping(key.block_tables, sequence[:, None], positions, key.kv_cache.shape[3])  # [T, K]
        return _absorbed("torch", query, key, None, scaling, softcap, dropout, (slots, valid))
    # K/V expanded from each sequence's latents, [1, Hkv, S * L, D]: sequence s's token p at s * L + p
    length = step.max_seq_len
    if key.shape[2] == length:  # one sequence (a prompt's whole prefill): its keys masked, as transformers computes it
        keep = torch.zeros(tokens, length + 1, dtype=torch.bool, device=query.device)
        keep = keep.scatter_(1, torch.where(valid, positions, length), True)[:, :length]  # [T, L]
        return dense_attention(query, key, value, keep[None, None], scale, softcap, sinks, dropout)
    rows = sequence[:, None] * length + positions  # [T, K]
    keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [S * L, Hkv, D]
    return gathered_attention(query[0].transpose(0, 1), keys, values, rows, valid, scale, softcap, sinks)[None]


# the most bytes gathered_attention gathers and scores at once (queries in chunks below it)
GATHER_BYTES = 1 << 28


def gathered_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Each query over its own keys: ``query [T, Hq, D]`` over the rows ``rows [T, K]`` of ``keys [R, Hkv, D]`` and
    ``values [R, Hkv, Dv]`` where ``valid [T, K]`` -> ``[T, Hq, Dv]`` (a query with no valid key gets zeros), in
    fp32, in chunks of queries of at most :data:`GATHER_BYTES`."""
    count, heads, width = query.shape
    kv_heads, group = keys.shape[1], heads // keys.shape[1]
    chosen = rows.shape[1]
    per_query = chosen * (kv_heads * (width + (0 if values is keys else values.shape[-1])) + 2 * heads) * 4
    chunk = max(1, GATHER_BYTES // max(per_query, 1))
    out = query.new_empty(count, heads, values.shape[-1])
    for first in range(0, count, chunk):
        part = slice(first, first + chunk)
        picked_keys = keys[rows[part]].float()  # [t, K, Hkv, D]
        picked_values = picked_keys if values is keys else values[rows[part]].float()  # (latent rows: one tensor)
        q = query[part].float().unflatten(1, (kv_heads, group))  # [t, Hkv, g, D]
        scores = torch.einsum("thgd,tkhd->thgk", q, picked_keys) * scale  # [t, Hkv, g, K]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~valid[part][:, None, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, kv_heads, group, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, sink], -1)
        probs = torch.softmax(scores, -1)[..., :chosen].nan_to_num(0.0)  # all -inf (no valid key): zeros
        mixed = torch.einsum("thgk,tkhd->thgd", probs, picked_values)  # [t, Hkv, g, Dv]
        out[part] = mixed.flatten(1, 2).to(out.dtype)
    return out


def _dense_visibility(module, attention_mask, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """``[B, Sq, Skv]`` bool: which keys each query sees by its ``attention_mask`` (a KernelMask, a bool or additive
    ``[B, 1, Sq, Skv]`` tensor, or None: causal, aligned to the last keys)."""
    if attention_mask is None:
        attention_mask = implicit_mask(module, query, key, kwargs)
    if isinstance(attention_mask, KernelMask):
        attention_mask = dense_mask(attention_mask, query, key)
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return visible[:, 0].expand(query.shape[0], query.shape[2], key.shape[2])


def _attention_temperature(module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor | None):
    """``query [1, Hq, T, D]`` of a packed forward scaled as Llama 4's no-RoPE layers scale a token's query at its
    position in its sequence (``positions [T]``): transformers scales by its index in the forward instead (the
    packed cache has no one length), by 1 in a forward of fewer than ``floor_scale`` tokens
    (``hfaccel.runner.runner.packed_token_limit``)."""
    if positions is None or not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", 1):
        return query
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0  # [T]
    return (query * scales[None, None, :, None]).to(query.dtype)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _paged_kernel_serves(mask, dropout: float, query: torch.Tensor) -> bool:
    """The paged kernel is causal, without dropout or autograd; anything else runs on gathered K/V."""
    return isinstance(mask, KernelMask) and mask.causal and dropout == 0.0 and not _needs_autograd(query)


def _paged(
    backend: str,
    query: torch.Tensor,
    kv: PagedKV,
    mask: KernelMask,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    # query: [B, Hq, Sq, D] -> [B, Sq, Hq, D], reading K/V from the pool through the block tables
    return paged_attention_op(
        query,
        kv.kv_cache,
        kv.layer,
        kv.block_tables,
        kv.seq_lens,
        None,
        query.shape[2],
        kv.max_seq_len,
        softmax_scale(scaling, query),
        mask.key_mask if kv.padding is None else None,
        mask.sliding_window,
        mask.chunk_size,
        softcap,
        sinks,
        backend,
        kv.kv_scales,
    )


def _packed(
    backend: str,
    query: torch.Tensor,
    kv: PagedKV,
    mask,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
    sliding_window: int | None,
    joined: bool = False,
) -> torch.Tensor:
    # query: [1, Hq, T, D] (every sequence's new tokens in one row) -> [1, T, Hq, D]; joined: a latent layer's rows
    # read as one (hfaccel.kv.latent)
    if not _paged_kernel_serves(mask, dropout, query):
        raise NotImplementedError(
            "packed sequences (hfaccel's engine and speculative decoding) run only on the causal paged kernel, "
            f"without dropout or autograd; got mask {type(mask).__name__}, dropout {dropout}, "
            f"grad {_needs_autograd(query)}"
        )
    return paged_attention_op(
        query,
        kv.kv_cache,
        kv.layer,
        kv.block_tables,
        kv.seq_lens,
        kv.cu_seqlens_q,
        kv.max_seqlen_q,
        kv.max_seq_len,
        softmax_scale(scaling, query),
        None,
        sliding_window,
        kv.chunk,
        softcap,
        sinks,
        backend,
        kv.kv_scales,
        joined,
    )


def auto_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention registered as ``hfaccel``: hfaccel's Triton kernels where they run; elsewhere (the CPU, MPS)
    transformers' own SDPA attention for dense calls (:func:`auto_mask` made its mask), the torch paths for what it
    does not compute (softcap, KernelMasks), and the batched torch paged attention for paged calls."""
    if (
        query.device.type != "cuda"
        and not isinstance(key, PagedKV)
        and not isinstance(attention_mask, KernelMask)
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not selects_keys(kwargs.get("indices"), key, None)
        and kwargs.get("position_bias") is None
        and not interpreting()
    ):
        record_path(module, SDPA)
        return compat.sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return _attention("auto", module, query, key, value, attention_mask, **kwargs)


def triton_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention registered as ``hfaccel_triton``: always the Triton kernel."""
    return _attention("triton", module, query, key, value, attention_mask, **kwargs)


def torch_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention registered as ``hfaccel_torch``: always the pure-torch reference."""
    return _attention("torch", module, query, key, value, attention_mask, **kwargs)


# by kernel backend; each declares that it reads the paged pool (hfaccel.kv.hf_cache)
ATTENTION_FUNCTIONS = {"auto": auto_attention, "triton": triton_attention, "torch": torch_attention}
MASK_FUNCTIONS = {"auto": auto_mask, "triton": kernel_mask, "torch": kernel_mask}
for _backend, _function in ATTENTION_FUNCTIONS.items():
    setattr(_function, PAGED_READER_ATTRIBUTE, _backend)


def _warn_fallback(reason: str) -> None:
    warnings.warn(f"hfaccel: attention runs on torch instead of hfaccel's kernels: {reason}", stacklevel=3)
