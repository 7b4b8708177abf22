"""hfaccel's mask functions, as transformers' ``AttentionMaskInterface`` sees them: transformers' mask request
turned into a :class:`KernelMask` (offsets, per-row key padding, causal / sliding window) instead of a
``[B, 1, Sq, Skv]`` tensor, or a dense bool mask for a pattern the kernels do not implement."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hfaccel import compat
from hfaccel.kernels.flash_attention import visibility_mask
from hfaccel.kernels.runtime import triton_can_run


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
    kv_length: int | None = None  # how many keys, where known (for its dense view)
    device: torch.device | str | None = None  # where its dense view goes, where it has no key mask to say

    # transformers treats a prepared 4-D mask (e.g. from generate()'s create_masks_for_generate with a static
    # cache) as final; a KernelMask passed back into the model is final too (see kernel_mask).
    ndim = 4

    def __getitem__(self, index) -> KernelMask | torch.Tensor:
        """The mask of a run of its queries, ``mask[:, :, queries, :]``, as of the ``[B, 1, Sq, Skv]`` mask it stands
        for (Gemma 4's KV-shared layers keep only the last queries of a prefill); or its one head, ``mask[:, 0]``
        (``mask[:, 0, :, :]``), as the dense ``[B, Sq, Skv]`` bool tensor a sparse-attention indexer reads — a packed
        forward's mask (its counts unknown) itself, which hfaccel's indexer forward replaces (hfaccel.kv.indexer)."""
        whole = slice(None)
        if isinstance(index, tuple) and len(index) in (2, 4) and index[1] == 0 and all(i == whole for i in index[::2]):
            if len(index) == 2 or index[3] == whole:
                return self if self.q_length is None else self.dense_head()
        if not (
            isinstance(index, tuple)
            and len(index) == 4
            and index[0] == index[1] == index[3] == whole
            and isinstance(index[2], slice)
            and index[2].step in (None, 1)
        ):
            raise TypeError(f"a KernelMask takes only mask[:, :, start:stop, :] (a run of its queries); got {index!r}")
        queries = index[2]
        if queries.start in (None, 0) and queries.stop is None:
            return self
        if self.q_length is None:
            raise TypeError("this KernelMask does not know its query count, so its queries cannot be sliced")
        start, stop, _ = queries.indices(self.q_length)
        return replace(self, q_offset=self.q_offset + start, q_length=max(stop - start, 0))

    def dense_head(self) -> torch.Tensor:
        """The ``[B, Sq, Skv]`` bool mask (True = attend) this mask stands for; a ``TypeError`` where it does not know
        its query and key counts."""
        if self.q_length is None or self.kv_length is None:
            raise TypeError("this KernelMask does not know its query and key counts, so it has no dense view")
        batch = 1 if self.key_mask is None else self.key_mask.shape[0]
        device = self.key_mask.device if self.key_mask is not None else self.device
        return self.visible(batch, self.q_length, self.kv_length, device)[:, 0]

    def visible(self, batch: int, q_length: int, kv_length: int, device) -> torch.Tensor:
        """The ``[B, 1, Sq, Skv]`` bool mask (True = attend) it stands for, at those sizes."""
        return visibility_mask(
            batch,
            q_length,
            kv_length,
            causal=self.causal,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            key_mask=self.key_mask,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            device=device,
        )

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
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            use_vmap=use_vmap,
            **kwargs,
        )
    padding = compat.padding_mask(attention_mask, kv_length, kv_offset)
    key_mask = None if padding is None else padding[:, kv_offset : kv_offset + kv_length].bool()
    if on_device:
        return _one_query_mask(pattern, batch_size, kv_length, q_offset, int(kv_offset), key_mask)
    return KernelMask(
        key_mask=key_mask,
        q_offset=int(q_offset),
        kv_offset=int(kv_offset),
        causal=pattern.causal,
        sliding_window=pattern.sliding_window,
        q_length=q_length,
        kv_length=kv_length,
        device=kwargs.get("device"),
    )


def auto_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
):
    """The ``auto`` backend's mask function: :func:`kernel_mask` where hfaccel's kernels run, transformers' ``sdpa``
    mask where they do not (the CPU, MPS), for ``hfaccel.attention.functions.auto_attention`` to hand to
    transformers' SDPA attention."""
    arguments = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        use_vmap=use_vmap,
        **kwargs,
    )
    if isinstance(attention_mask, KernelMask) or triton_can_run(device):
        return kernel_mask(**arguments)
    return compat.sdpa_mask(device=device, **arguments)


def _one_query_mask(
    pattern: compat.MaskPattern,
    batch_size: int,
    kv_length: int,
    q_offset: torch.Tensor,
    kv_offset: int,
    key_mask: torch.Tensor | None,
) -> KernelMask:
    """The mask of one query per row at position ``q_offset`` (a 0-d device tensor), with no host read: the
    pattern's causal and window rules become key padding ``[B, Skv]``, which the kernels take as it is (they then
    run over every key, those the query may not see hidden)."""
    visible = visibility_mask(
        batch_size,
        1,
        kv_length,
        causal=pattern.causal,
        q_offset=q_offset,
        kv_offset=kv_offset,
        key_mask=key_mask,
        sliding_window=pattern.sliding_window,
        device=q_offset.device,
    )  # [B, 1, 1, Skv]
    return KernelMask(
        key_mask=visible[:, 0, 0],
        q_offset=0,
        kv_offset=0,
        causal=False,
        sliding_window=None,
        q_length=1,
        kv_length=kv_length,
    )


def implicit_mask(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> KernelMask:
    """The mask transformers means by ``attention_mask=None``: no padding, queries aligned to the last keys."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    return KernelMask(None, key.shape[2] - query.shape[2], 0, causal, None)


def dense_mask(mask: KernelMask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The ``[B, 1, Sq, Skv]`` bool mask (True = attend) a :class:`KernelMask` stands for, for the torch paths."""
    return mask.visible(query.shape[0], query.shape[2], key.shape[2], query.device)
