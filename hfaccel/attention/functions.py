"""hfaccel's attention and mask functions, as transformers' ``AttentionInterface`` sees them.

The mask function turns transformers' mask request into a :class:`KernelMask` (offsets, per-row key
padding, causal / sliding window) instead of a ``[B, 1, Sq, Skv]`` tensor; the attention function hands it
to :func:`hfaccel.kernels.flash_attention`. Whatever the kernels do not implement (an unrecognised mask
pattern, dropout while training, autograd) is served by an exact torch path instead, never approximated.

Routing: a plain causal prefill (queries aligned to the keys, no padding, no window that hides a key, no
softcap) is exactly what torch SDPA computes; the ``auto`` backend sends it to SDPA (cuDNN / flash) on CUDA
when the GPU's tuned table measured SDPA faster for the shape (:func:`prefill_route`). Everything SDPA cannot
express stays on hfaccel's kernels. On a device where hfaccel's kernels do not run (the CPU, MPS), ``auto`` serves
every dense call by SDPA as transformers' ``sdpa`` does (:func:`_sdpa`; the torch reference kernels are for
checking, the ``torch`` backend), and paged calls by the batched torch paged attention. Which path served each
eager call is counted in the model's
:class:`AttentionPaths` (``model.hfaccel.attention_paths``): a host-side decision, no device sync.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hfaccel import compat
from hfaccel.kernels import flash_attention_reference
from hfaccel.kernels.flash_attention import sdpa_preferred, visibility_mask
from hfaccel.kernels.ops import flash_attention_op, paged_attention_op
from hfaccel.kernels.runtime import interpreting, resolve_backend, triton_can_run
from hfaccel.kv.hf_cache import PAGED_READER_ATTRIBUTE, PagedKV

# What served a call, as AttentionPaths counts it.
SDPA, FLASH, PAGED, TORCH = "sdpa", "hfaccel flash", "hfaccel paged", "torch"
PATHS_ATTRIBUTE = "hfaccel_attention_paths"  # where a tracked model's attention modules keep their AttentionPaths


class AttentionPaths:
    """How many eager attention calls of one model each path served (``sdpa``; hfaccel's ``flash`` or ``paged``
    kernel, with the backend that ran it: ``triton`` or the ``torch`` reference; ``torch`` for the exact fallbacks),
    and the last one. Calls inside a ``torch.compile``d step are not counted: their path was fixed when the step
    was traced (decode steps: the paged kernel)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.last: str | None = None

    def record(self, path: str) -> None:
        self.counts[path] += 1
        self.last = path

    def __str__(self) -> str:
        if not self.counts:
            return "no eager attention call yet"
        calls = ", ".join(f"{path} {count}" for path, count in self.counts.most_common())
        return f"{calls} (last: {self.last})"

    def __repr__(self) -> str:
        return f"AttentionPaths({dict(self.counts)}, last={self.last!r})"


@dataclass(frozen=True)
class KernelMask:
    """Who may attend to whom, in the form the kernels read (see ``hfaccel.kernels.flash_attention``)."""

    key_mask: torch.Tensor | None  # [B, Skv] bool, False = padding; None = every key is real
    q_offset: int  # absolute position of query 0
    kv_offset: int  # absolute position of key 0
    causal: bool
    sliding_window: int | None
    chunk_size: int | None = None  # chunked attention (Llama 4): keys from the start of the query's chunk on
    q_length: int | None = None  # how many queries it covers, where known (for slicing them)

    # transformers treats a prepared 4-D mask (e.g. from generate()'s create_masks_for_generate with a static
    # cache) as final; a KernelMask passed back into the model is final too (see kernel_mask).
    ndim = 4

    def __getitem__(self, index) -> KernelMask:
        """The mask of a run of its queries, ``mask[:, :, queries, :]``, as of the ``[B, 1, Sq, Skv]`` mask it stands
        for (Gemma 4's KV-shared layers keep only the last queries of a prefill)."""
        whole = slice(None)
        if not (isinstance(index, tuple) and len(index) == 4 and index[0] == index[1] == index[3] == whole
                and isinstance(index[2], slice) and index[2].step in (None, 1)):
            raise TypeError(f"a KernelMask takes only mask[:, :, start:stop, :] (a run of its queries); got {index!r}")
        queries = index[2]
        if queries.start in (None, 0) and queries.stop is None:
            return self
        if self.q_length is None:
            raise TypeError("this KernelMask does not know its query count, so its queries cannot be sliced")
        start, stop, _ = queries.indices(self.q_length)
        return replace(self, q_offset=self.q_offset + start, q_length=max(stop - start, 0))

    def contiguous(self) -> KernelMask:
        # generate() makes static-cache masks contiguous before compiled decode steps.
        if self.key_mask is None or self.key_mask.is_contiguous():
            return self
        return replace(self, key_mask=self.key_mask.contiguous())


# What the runner passes as ``attention_mask``: each packed sequence attends causally to its own blocks, each layer
# with the sliding window its module passes (``sliding_window``, as transformers' varlen flash path reads it) or the
# window or chunk its cache layer holds (``PagedKV``). A
# given KernelMask is final, so the model's mask functions are never introspected inside a compiled step (dynamo
# cannot read a closure built in the graph) and a decode forward builds no mask at all.
PACKED_MASK = KernelMask(key_mask=None, q_offset=0, kv_offset=0, causal=True, sliding_window=None)


def packed_mask(config) -> KernelMask | dict[str, KernelMask]:
    """The ``attention_mask`` of a packed forward of a model with this (text) config: :data:`PACKED_MASK`, or where
    a layer type's mask function reads the padding mask before any mask interface sees it (chunked attention:
    transformers' ``create_chunked_causal_mask`` counts the left padding), the mapping of each layer type to it,
    which such models take as their masks already made."""
    layer_types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" not in layer_types:
        return PACKED_MASK
    return dict.fromkeys(layer_types, PACKED_MASK)


def kernel_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> KernelMask | torch.Tensor | None:
    """transformers ``AttentionMaskInterface`` function: a :class:`KernelMask`, or a dense bool mask for a
    pattern the kernels do not implement natively.

    A ``q_offset`` tensor (transformers' StaticCache keeps its length on the device) is never read on the host: one
    query per row gets a key mask that holds the causal and window rules (:func:`_one_query_mask`); several get the
    dense mask, built on the device.
    """
    if isinstance(attention_mask, KernelMask):
        return attention_mask
    pattern = None if use_vmap else compat.describe_mask_function(mask_function, local_size, kwargs.get("config"))
    on_device = isinstance(q_offset, torch.Tensor)
    if pattern is None or on_device and q_length > 1:
        return compat.dense_bool_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            local_size=local_size, use_vmap=use_vmap, **kwargs)
    padding = compat.padding_mask(attention_mask, kv_length, kv_offset)
    key_mask = None if padding is None else padding[:, kv_offset:kv_offset + kv_length].bool()
    if on_device:
        return _one_query_mask(pattern, batch_size, kv_length, q_offset, int(kv_offset), key_mask)
    return KernelMask(key_mask=key_mask, q_offset=int(q_offset), kv_offset=int(kv_offset),
                      causal=pattern.causal, sliding_window=pattern.sliding_window, q_length=q_length)


def auto_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0, kv_offset: int = 0,
              mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
              use_vmap: bool = False, device: torch.device | str = "cpu", **kwargs):
    """The ``auto`` backend's mask function: :func:`kernel_mask` where hfaccel's kernels run, transformers' ``sdpa``
    mask where they do not (the CPU, MPS), for :func:`auto_attention` to hand to transformers' SDPA attention."""
    arguments = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, use_vmap=use_vmap, **kwargs)
    if isinstance(attention_mask, KernelMask) or triton_can_run(device):
        return kernel_mask(**arguments)
    return compat.sdpa_mask(device=device, **arguments)


def _one_query_mask(pattern: compat.MaskPattern, batch_size: int, kv_length: int, q_offset: torch.Tensor,
                    kv_offset: int, key_mask: torch.Tensor | None) -> KernelMask:
    """The mask of one query per row at position ``q_offset`` (a 0-d device tensor), with no host read: the
    pattern's causal and window rules become key padding ``[B, Skv]``, which the kernels take as it is (they then
    run over every key, those the query may not see hidden)."""
    visible = visibility_mask(batch_size, 1, kv_length, causal=pattern.causal, q_offset=q_offset, kv_offset=kv_offset,
                              key_mask=key_mask, sliding_window=pattern.sliding_window,
                              device=q_offset.device)  # [B, 1, 1, Skv]
    return KernelMask(key_mask=visible[:, 0, 0], q_offset=0, kv_offset=0, causal=False, sliding_window=None)


def _implicit_mask(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> KernelMask:
    """The mask transformers means by ``attention_mask=None``: no padding, queries aligned to the last keys."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    return KernelMask(None, key.shape[2] - query.shape[2], 0, causal, None)


def _attention(backend: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask, scaling: float | None = None, dropout: float = 0.0,
               **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, Sq, D]; key, value: [B, Hkv, Skv, D]; returns ([B, Sq, Hq, D], None)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # s_aux: [Hq] attention sinks (gpt-oss)
    if isinstance(key, PagedKV) and key.cu_seqlens_q is not None:
        window = kwargs.get("sliding_window") or key.window  # the layer's window, passed or as its cache holds it
        if key.dense is None or not _paged_kernel_serves(attention_mask, dropout, query):
            _record(module, PAGED, backend, query)
            return _packed(backend, query, key, attention_mask, scaling, softcap, sinks, dropout, window), None
        # one sequence's whole prompt: causal attention over its own new K/V, as any dense prefill
        attention_mask = replace(PACKED_MASK, sliding_window=window, chunk_size=key.chunk)
    if isinstance(key, PagedKV):
        if key.dense is None and _paged_kernel_serves(attention_mask, dropout, query):
            _record(module, PAGED, backend, query)
            return _paged(backend, query, key, attention_mask, scaling, softcap, sinks), None
        key, value = key.gather()  # a prefill's own K/V, or a gather for what the paged kernel lacks
    if attention_mask is None:
        attention_mask = _implicit_mask(module, query, key, kwargs)
    if not isinstance(attention_mask, KernelMask):
        _record(module, TORCH)
        return _dense_attention(query, key, value, attention_mask, scaling, softcap, sinks, dropout), None
    if dropout > 0.0:
        _warn_fallback("attention dropout is active (model in training mode)")
        _record(module, TORCH)
        return _dense_attention(query, key, value, _to_dense(attention_mask, query, key), scaling, softcap, sinks,
                                dropout), None
    mask = attention_mask
    if prefill_route(backend, query, key, mask, softcap, sinks) == SDPA:  # exact, and differentiable
        _record(module, SDPA)
        return _sdpa(query, key, value, mask, scaling, softcap, sinks), None
    if _needs_autograd(query, key, value):  # differentiable
        _record(module, TORCH)
        return flash_attention_reference(query, key, value, scale=scaling, causal=mask.causal,
                                         q_offset=mask.q_offset, kv_offset=mask.kv_offset, key_mask=mask.key_mask,
                                         sliding_window=mask.sliding_window, chunk_size=mask.chunk_size,
                                         softcap=softcap, sinks=sinks), None
    _record(module, FLASH, backend, query)
    return flash_attention_op(query, key, value, mask.key_mask, _scale(scaling, query), mask.causal, mask.q_offset,
                              mask.kv_offset, mask.sliding_window, mask.chunk_size, softcap, sinks, backend), None


def sdpa_computes(query: torch.Tensor, key: torch.Tensor, mask: KernelMask, softcap: float | None,
                  sinks: torch.Tensor | None = None) -> bool:
    """Whether ``F.scaled_dot_product_attention(..., is_causal=True)`` computes exactly this call: causal with the
    queries aligned to the keys (same count, same offset: SDPA's causal mask is top-left aligned), no key padding,
    no sliding window or chunk that hides a key, no softcap, no sinks."""
    window = mask.sliding_window
    return (mask.causal and mask.key_mask is None and softcap is None and sinks is None
            and (window is None or window >= key.shape[2]) and _one_chunk(query, key, mask)
            and query.shape[2] == key.shape[2] and mask.q_offset == mask.kv_offset)


def prefill_route(backend: str, query: torch.Tensor, key: torch.Tensor, mask: KernelMask,
                  softcap: float | None, sinks: torch.Tensor | None = None) -> str:
    """``"sdpa"`` or ``"hfaccel flash"``: the path of a dense call of the ``backend`` attention. Only ``auto`` routes:
    on a device where hfaccel's kernels do not run (the CPU without the Triton interpreter, MPS), every call to SDPA
    (:func:`_sdpa`); on CUDA, only 16-bit calls that SDPA computes exactly as they are, and only where the GPU's
    tuned table says SDPA is the faster (or has no measurement: ``hfaccel.kernels.flash_attention.sdpa_preferred``).
    Host-side: shapes, dtype and one table lookup; inside a ``torch.compile`` trace, which cannot read the table,
    SDPA."""
    if backend == "auto" and not triton_can_run(query.device):
        return SDPA
    if not (backend == "auto" and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and sdpa_computes(query, key, mask, softcap, sinks)):
        return FLASH
    if torch.compiler.is_compiling():  # a trace cannot read the table (a file); what the table says without an entry
        return SDPA
    return SDPA if sdpa_preferred(query.shape[-1], query.shape[1] // key.shape[1], query.shape[2], query.dtype,
                                  query.device) else FLASH


def sees_every_key(query: torch.Tensor, key: torch.Tensor, mask: KernelMask) -> bool:
    """Whether every query of this call sees every key (no padding, no window or chunk hiding a key, causal or not,
    the first query at or past the last key): SDPA with no mask computes it exactly (a decode step)."""
    last_key = mask.kv_offset + key.shape[2] - 1
    window = mask.sliding_window
    return (mask.key_mask is None and (not mask.causal or mask.q_offset >= last_key)
            and (window is None or mask.q_offset + query.shape[2] - 1 - mask.kv_offset < window)
            and _one_chunk(query, key, mask))


def _one_chunk(query: torch.Tensor, key: torch.Tensor, mask: KernelMask) -> bool:
    """Whether the call's first key and last query share one chunk (no chunk hides a key), or there are none."""
    chunk = mask.chunk_size
    last_query = mask.q_offset + query.shape[2] - 1
    return chunk is None or mask.kv_offset // chunk == last_query // chunk


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: KernelMask, scaling: float | None,
          softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The SDPA route (:func:`prefill_route`) as transformers' ``sdpa`` computes attention: ``is_causal`` when the
    queries align with the keys, no mask when every query sees every key, else the dense mask (softcap, sinks: the
    exact torch formula). ``[B, Sq, Hq, D]``."""
    if sdpa_computes(query, key, mask, softcap, sinks):
        return sdpa_causal(query, key, value, scaling)
    dense = None if softcap is None and sees_every_key(query, key, mask) else _to_dense(mask, query, key)
    return _dense_attention(query, key, value, dense, scaling, softcap, sinks, 0.0)


def sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """The SDPA route: ``query [B, Hq, S, D]`` over ``key, value [B, Hkv, S, D]`` (aligned, causal) ->
    ``[B, S, Hq, D]``, GQA without repeating K/V."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=_scale(scaling, query),
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def _record(module: torch.nn.Module, path: str, backend: str | None = None, query: torch.Tensor | None = None) -> None:
    """Count the path in the module's AttentionPaths (a model that ``accelerate`` tracks; eager calls only).
    hfaccel's kernels are named with the backend that runs them (``hfaccel flash (triton)``)."""
    if torch.compiler.is_compiling():
        return
    paths = getattr(module, PATHS_ATTRIBUTE, None)
    if paths is not None:
        paths.record(path if backend is None else f"{path} ({resolve_backend(backend, query.device)})")


def _scale(scaling: float | None, query: torch.Tensor) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else float(scaling)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _paged_kernel_serves(mask, dropout: float, query: torch.Tensor) -> bool:
    """The paged kernel is causal, without dropout or autograd; anything else runs on gathered K/V."""
    return isinstance(mask, KernelMask) and mask.causal and dropout == 0.0 and not _needs_autograd(query)


def _paged(backend: str, query: torch.Tensor, kv: PagedKV, mask: KernelMask, scaling: float | None,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    # query: [B, Hq, Sq, D] -> [B, Sq, Hq, D], reading K/V from the pool through the block tables
    return paged_attention_op(query, kv.kv_cache, kv.layer, kv.block_tables, kv.seq_lens, None, query.shape[2],
                              kv.max_seq_len, _scale(scaling, query), mask.key_mask if kv.padding is None else None,
                              mask.sliding_window, mask.chunk_size, softcap, sinks, backend, kv.kv_scales)


def _packed(backend: str, query: torch.Tensor, kv: PagedKV, mask, scaling: float | None, softcap: float | None,
            sinks: torch.Tensor | None, dropout: float, sliding_window: int | None) -> torch.Tensor:
    # query: [1, Hq, T, D] (every sequence's new tokens in one row) -> [1, T, Hq, D]
    if not _paged_kernel_serves(mask, dropout, query):
        raise NotImplementedError(
            "packed sequences (hfaccel's engine and speculative decoding) run only on the causal paged kernel, "
            f"without dropout or autograd; got mask {type(mask).__name__}, dropout {dropout}, "
            f"grad {_needs_autograd(query)}")
    return paged_attention_op(query, kv.kv_cache, kv.layer, kv.block_tables, kv.seq_lens, kv.cu_seqlens_q,
                              kv.max_seqlen_q, kv.max_seq_len, _scale(scaling, query), None, sliding_window, kv.chunk,
                              softcap, sinks, backend, kv.kv_scales)


def auto_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention registered as ``hfaccel``: hfaccel's Triton kernels where they run; elsewhere (the CPU, MPS)
    transformers' own SDPA attention for dense calls (:func:`auto_mask` made its mask), the torch paths for what it
    does not compute (softcap, KernelMasks), and the batched torch paged attention for paged calls."""
    if (query.device.type != "cuda" and not isinstance(key, PagedKV) and not isinstance(attention_mask, KernelMask)
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not interpreting()):
        _record(module, SDPA)
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


def _to_dense(mask: KernelMask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return visibility_mask(query.shape[0], query.shape[2], key.shape[2], causal=mask.causal,
                           q_offset=mask.q_offset, kv_offset=mask.kv_offset, key_mask=mask.key_mask,
                           sliding_window=mask.sliding_window, chunk_size=mask.chunk_size, device=query.device)


def _dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None, softcap: float | None, sinks: torch.Tensor | None,
                     dropout: float) -> torch.Tensor:
    """Exact torch attention with a dense mask ``[B, 1|Hq, Sq, Skv]`` (bool: True = attend; float: additive; None:
    every query sees every key), softcapped logits and sinks ``[Hq]`` (one more logit per query head, as
    transformers' eager attention appends it)."""
    group = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=group > 1)
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
    probs = torch.softmax(scores.float(), -1)[..., :key.shape[2]]
    probs = F.dropout(probs.to(value.dtype), p=dropout, training=dropout > 0)
    return (probs @ value).transpose(1, 2).contiguous()


def _warn_fallback(reason: str) -> None:
    warnings.warn(f"hfaccel: attention runs on torch instead of hfaccel's kernels: {reason}", stacklevel=3)
