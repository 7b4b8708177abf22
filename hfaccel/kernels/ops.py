"""hfaccel's kernels as torch custom ops (``torch.ops.hfaccel.*``): what the model's forward calls.

An op is opaque to ``torch.compile``: dynamo records one call, inductor fuses the glue around it (norms, RoPE,
SiLU·mul, residual adds — most of a decode step's kernels), and a fullgraph trace of an accelerated model has no
graph break. ``torch.library.custom_op`` with ``register_fake`` is the registration chosen over ``triton_op``: each
launcher picks its configuration on the host from shapes (heuristics or the tuned table) and runs the Triton
kernel — compiled on CUDA, interpreted on the CPU under ``TRITON_INTERPRET=1`` — or the pure-torch reference; an
opaque op keeps that host logic out of the trace, and inductor does not fuse user Triton kernels with its own
anyway. Scalars have fixed schema types (``float`` reaches Triton as fp32), host ints that size a launch are
plain ints, and no op reads a tensor's values on the host on CUDA. Outputs are fresh contiguous tensors, exactly
as the fake implementations describe them. The paged ops take the whole pool tensor and a layer index, never a
layer's views: torch.compile(dynamic=True) miscompiles a custom op that mutates a view made outside the op (torch
2.13: the writes land elsewhere; tests/runner/test_runner.py checks compiled steps against eager ones).
"""

from __future__ import annotations

import torch

from hfaccel.kernels.flash_attention import flash_attention
from hfaccel.kernels.fp8 import fp8_matmul
from hfaccel.kernels.keyed_race import keyed_race
from hfaccel.kernels.lora import lora_apply
from hfaccel.kernels.paged_attention import paged_attention
from hfaccel.kernels.w4a16 import w4a16_matmul
from hfaccel.kernels.write_kv import write_kv


@torch.library.custom_op("hfaccel::flash_attention", mutates_args=())
def flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    q_offset: int,
    kv_offset: int,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``q [B, Hq, Sq, D]`` over ``k, v [B, Hkv, Skv, D]`` -> ``[B, Sq, Hq, D]``
    (``hfaccel.kernels.flash_attention``)."""
    return flash_attention(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        q_offset=q_offset,
        kv_offset=kv_offset,
        key_mask=key_mask,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        softcap=softcap,
        sinks=sinks,
        backend=backend,
    ).contiguous()


@flash_attention_op.register_fake
def _(q, k, v, key_mask, scale, causal, q_offset, kv_offset, sliding_window, chunk_size, softcap, sinks, backend):
    batch, heads, seq, head_dim = q.shape
    return q.new_empty(batch, seq, heads, head_dim)


@torch.library.custom_op("hfaccel::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    key_mask: torch.Tensor | None,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    backend: str,
    kv_scales: torch.Tensor | None = None,
    joined: bool = False,
) -> torch.Tensor:
    """Attention over layer ``layer`` of the paged pool ``kv_cache [L, 2, num_blocks, block_size, Hkv, D]`` (an fp8
    pool with its per-head scales ``kv_scales [L, 2, Hkv]``; ``hfaccel.kernels.paged_attention``):
    ``q [B, Hq, Sq, D]`` -> ``[B, Sq, Hq, D]``, dense, or packed with ``cu_seqlens_q`` (``B`` = 1: the one row holds
    every sequence's tokens). The packed query is re-viewed as ``[T, Hq, D]`` inside the op, not in the traced
    graph: inductor's lowering of that select guards on T > 1 for some query layouts (a query straight from its
    projection, no RoPE), giving batch 1 a graph of its own. ``joined``: a layer of one KV head whose key and value
    rows of a token lie one after the other (a latent layer's: ``hfaccel.kv.pool``), read as one row ``2 * D`` wide
    for both keys and values (``q [B, Hq, Sq, 2 * D]``)."""
    packed = cu_seqlens_q is not None
    keys, values = (joined_rows(kv_cache[layer]),) * 2 if joined else (kv_cache[layer, 0], kv_cache[layer, 1])
    out = paged_attention(
        q[0].transpose(0, 1) if packed else q,
        keys,
        values,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=scale,
        key_mask=key_mask,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        softcap=softcap,
        sinks=sinks,
        backend=backend,
        **_layer_scales(kv_scales, layer),
    )
    return (out[None] if packed else out).contiguous()


@paged_attention_op.register_fake
def _(
    q,
    kv_cache,
    layer,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    key_mask,
    sliding_window,
    chunk_size,
    softcap,
    sinks,
    backend,
    kv_scales=None,
    joined=False,
):
    batch, heads, seq, head_dim = q.shape
    return q.new_empty(batch, seq, heads, head_dim)


def joined_rows(layer_kv: torch.Tensor) -> torch.Tensor:
    """``layer_kv [2, num_blocks, block_size, 1, D]`` whose key and value rows of a token lie one after the other
    as one row per token, ``[num_blocks, block_size, 1, 2 * D]`` (a view); a ValueError for any other layout."""
    _, blocks, size, heads, width = layer_kv.shape
    step = layer_kv.stride()
    if heads != 1 or step[0] != width or step[2] != 2 * width or step[4] != 1 or step[1] != size * step[2]:
        raise ValueError(
            "joined rows need one KV head whose key and value rows of each token lie one after the other; got shape "
            f"{tuple(layer_kv.shape)}, strides {step}"
        )
    return layer_kv[0].as_strided((blocks, size, 1, 2 * width), (step[1], step[2], 2 * width, 1))


@torch.library.custom_op("hfaccel::write_kv", mutates_args=("kv_cache",))
def write_kv_op(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    backend: str,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store ``k, v [B, S, Hkv, D]`` into layer ``layer`` of the pool ``kv_cache [L, 2, num_blocks, block_size,
    Hkv, D]`` at ``slot_mapping [B, S]`` (an fp8 pool quantized by its per-head scales ``kv_scales [L, 2, Hkv]``;
    ``hfaccel.kernels.write_kv``)."""
    write_kv(
        k, v, kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping, backend=backend, **_layer_scales(kv_scales, layer)
    )


@write_kv_op.register_fake
def _(k, v, kv_cache, layer, slot_mapping, backend, kv_scales=None) -> None:
    return None


def _layer_scales(kv_scales: torch.Tensor | None, layer: int) -> dict[str, torch.Tensor]:
    """The kernels' ``k_scale, v_scale [Hkv]`` of one layer of a pool's ``kv_scales [L, 2, Hkv]`` (none: {})."""
    return {} if kv_scales is None else {"k_scale": kv_scales[layer, 0], "v_scale": kv_scales[layer, 1]}


@torch.library.custom_op("hfaccel::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, backend: str
) -> torch.Tensor:
    """``x [M, K]`` times the int4 weight ``[K, N]`` -> ``[M, N]`` (``hfaccel.kernels.w4a16``)."""
    return w4a16_matmul(x, qweight, scales, zeros, group_size, backend=backend).contiguous()


@w4a16_matmul_op.register_fake
def _(x, qweight, scales, zeros, group_size, backend):
    return x.new_empty(x.shape[0], qweight.shape[1])


@torch.library.custom_op("hfaccel::fp8_matmul", mutates_args=())
def fp8_matmul_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int, backend: str
) -> torch.Tensor:
    """``x [M, K]`` times the fp8 weight ``[K, N]`` -> ``[M, N]`` (``hfaccel.kernels.fp8``)."""
    return fp8_matmul(x, weight, scales, group_k, group_n, backend=backend).contiguous()


@fp8_matmul_op.register_fake
def _(x, weight, scales, group_k, group_n, backend):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("hfaccel::lora", mutates_args=())
def lora_op(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    slots: list[int] | None,
    backend: str,
) -> torch.Tensor:
    """The base output ``y [T, N]`` plus ``x [T, K]`` through each row's adapter, A ``a [S, R, K]`` then B
    ``b [S, N, R]``, by ``index [T]`` (-1: none) -> a new ``[T, N]`` in y's dtype (``hfaccel.kernels.lora.lora_apply``;
    ``slots``: the host hint of the slots that may appear, or None)."""
    return lora_apply(x, y, a, b, index, slots=slots, backend=backend).contiguous()


@lora_op.register_fake
def _(x, y, a, b, index, slots, backend):
    return y.new_empty(y.shape)


@torch.library.custom_op("hfaccel::keyed_race", mutates_args=())
def keyed_race_op(
    weights: torch.Tensor,
    seeds: torch.Tensor,
    streams: torch.Tensor,
    counters: torch.Tensor,
    purpose: int,
    backend: str,
) -> torch.Tensor:
    """Per row of ``weights [S, V]``, the token winning the race against Exp(1) noise keyed by (``seeds``,
    ``streams``, ``purpose``, ``counters``: ``[S]`` int64) -> ``[S]`` int64 (``hfaccel.kernels.keyed_race``)."""
    return keyed_race(weights, seeds, streams, counters, purpose, backend=backend)


@keyed_race_op.register_fake
def _(weights, seeds, streams, counters, purpose, backend):
    return weights.new_empty(weights.shape[0], dtype=torch.int64)
