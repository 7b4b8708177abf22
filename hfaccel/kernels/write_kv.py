"""Write new keys and values into the paged KV pool by slot mapping.

The pool of one layer is ``k_pool, v_pool: [num_blocks, block_size, Hkv, D]``; slot ``n`` is
``(n // block_size, n % block_size)``. New tokens ``k, v: [B, S, Hkv, D]`` (any strides, e.g. the transposed
view of transformers' ``[B, Hkv, S, D]``) go to ``slot_mapping: [B, S]``; a negative slot skips the token.

An fp8 pool (``torch.float8_e4m3fn``) stores each value divided by its KV head's scale (``k_scale, v_scale: [Hkv]``
fp32), saturated to e4m3's range: ``pool = fp8(clamp(x / scale, -448, 448))``; readers multiply by the scale back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import resolve_backend

KV_QUANT_DTYPES = (torch.float8_e4m3fn,)  # pool dtypes that store K/V quantized, with per-head scales
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: e4m3's largest finite value


@triton.jit
def _write_kv_kernel(
    K,
    V,
    K_POOL,
    V_POOL,
    SLOTS,
    K_SCALE,
    V_SCALE,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_pkb,
    stride_pks,
    stride_pkh,
    stride_pkd,
    stride_pvb,
    stride_pvs,
    stride_pvh,
    stride_pvd,
    stride_sb,
    stride_ss,
    seq,
    num_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    QMAX: tl.constexpr,
):
    # One program: one token, all its KV heads, K and V together ([BLOCK_H, BLOCK_D] tiles).
    token = tl.program_id(0)
    b = token // seq
    i = token % seq
    slot = tl.load(SLOTS + b * stride_sb + i * stride_ss).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < num_heads) & (d < head_dim)
        k = tl.load(K + b * stride_kb + i * stride_ks + h * stride_kh + d * stride_kd, mask=ok)
        v = tl.load(V + b * stride_vb + i * stride_vs + h * stride_vh + d * stride_vd, mask=ok)
        if QUANTIZE:  # per-head scales [Hkv]; e4m3 saturated, not inf
            k_scale = tl.load(K_SCALE + h, mask=h < num_heads, other=1.0)
            v_scale = tl.load(V_SCALE + h, mask=h < num_heads, other=1.0)
            k = tl.clamp(k.to(tl.float32) / k_scale, -QMAX, QMAX).to(K_POOL.dtype.element_ty)
            v = tl.clamp(v.to(tl.float32) / v_scale, -QMAX, QMAX).to(V_POOL.dtype.element_ty)
        tl.store(K_POOL + block * stride_pkb + offset * stride_pks + h * stride_pkh + d * stride_pkd, k, mask=ok)
        tl.store(V_POOL + block * stride_pvb + offset * stride_pvs + h * stride_pvh + d * stride_pvd, v, mask=ok)


def _check(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale) -> None:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"k and v must both be [batch, seq, kv_heads, head_dim]; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"k_pool and v_pool must both be [num_blocks, block_size, kv_heads, head_dim]; got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if k.shape[2:] != k_pool.shape[2:]:
        raise ValueError(
            f"new keys have (kv_heads, head_dim) {tuple(k.shape[2:])} but the pool holds {tuple(k_pool.shape[2:])}"
        )
    if slot_mapping.shape != k.shape[:2] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be an int32/int64 tensor of shape {tuple(k.shape[:2])}; got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if k.dtype != v.dtype or k_pool.dtype != v_pool.dtype:
        raise ValueError(
            f"k and v, and the two pools, must share a dtype; got {k.dtype}, {v.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    check_kv_scales(k_pool, k_scale, v_scale, k.dtype)
    if len({k.device, v.device, k_pool.device, v_pool.device, slot_mapping.device}) != 1:
        raise ValueError("k, v, the pools and slot_mapping must be on one device")


def check_kv_scales(
    pool: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, dtype: torch.dtype
) -> None:
    """A pool of one of :data:`KV_QUANT_DTYPES` takes fp32 ``k_scale, v_scale [Hkv]`` on its device and values of any
    16/32-bit float ``dtype``; any other pool takes no scales and values of its own dtype."""
    if pool.dtype not in KV_QUANT_DTYPES:
        if k_scale is not None or v_scale is not None or dtype != pool.dtype:
            raise ValueError(
                f"a {pool.dtype} pool holds {pool.dtype} keys and values, without scales; got "
                f"{dtype}{' with scales' if k_scale is not None or v_scale is not None else ''}"
            )
        return
    heads = pool.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.shape != (heads,) or scale.dtype != torch.float32 or scale.device != pool.device:
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
            raise ValueError(
                f"a {pool.dtype} pool needs {name}: fp32 [{heads}] (one per KV head) on {pool.device}; got {got}"
            )
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"keys and values for a {pool.dtype} pool are fp16, bf16 or fp32; got {dtype}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., Hkv, D]`` as an fp8 pool stores it: divided by its head's ``scale [Hkv]``, saturated, in ``dtype``."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored values ``x [..., Hkv, D]`` of an fp8 pool back in ``dtype``: times their head's ``scale [Hkv]``."""
    return (x.float() * scale[:, None]).to(dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k, v: [B, S, Hkv, D]`` into ``k_pool, v_pool`` at ``slot_mapping: [B, S]`` (in place); an fp8 pool
    with its per-head ``k_scale, v_scale [Hkv]`` (module docstring)."""
    _check(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)
    quantize = k_pool.dtype in KV_QUANT_DTYPES
    if resolve_backend(backend, k.device) == "torch":
        if quantize:
            k, v = quantize_kv(k, k_scale, k_pool.dtype), quantize_kv(v, v_scale, v_pool.dtype)
        write_kv_reference(k, v, k_pool, v_pool, slot_mapping)
        return
    batch, seq, heads, head_dim = k.shape
    if batch * seq == 0:
        return
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    _write_kv_kernel[(batch * seq,)](
        k,
        v,
        k_pool,
        v_pool,
        slot_mapping,
        *((k_scale, v_scale) if quantize else (slot_mapping, slot_mapping)),  # placeholders when not quantizing
        *k.stride(),
        *v.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *slot_mapping.stride(),
        seq,
        heads,
        head_dim,
        k_pool.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANTIZE=quantize,
        QMAX=FP8_MAX,
        num_warps=write_kv_warps(block_h * block_d),
    )


def write_kv_warps(tile: int) -> int:
    """Warps for a [BLOCK_H, BLOCK_D] tile: about 8 elements per thread, 1 to 8 warps."""
    return max(1, min(8, tile // 256))


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch definition of :func:`write_kv`: rows with slot -1 are skipped. On the CPU the kept rows are
    selected by a mask (nothing waits for it, and it is the fewest ops); elsewhere :func:`write_kv_on_device`."""
    if slot_mapping.device.type != "cpu":
        write_kv_on_device(k, v, k_pool, v_pool, slot_mapping)
        return
    slots = slot_mapping.reshape(-1).long()
    keep = slots >= 0
    heads, head_dim = k_pool.shape[2:]
    k_pool.view(-1, heads, head_dim)[slots[keep]] = k.reshape(-1, heads, head_dim)[keep]
    v_pool.view(-1, heads, head_dim)[slots[keep]] = v.reshape(-1, heads, head_dim)[keep]


def write_kv_on_device(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """:func:`write_kv_reference` with no host read, for a device the host would wait for (the ``torch`` backend's
    decode steps on a GPU, captured in CUDA graphs: a mask's selection waits for its count, and fails a capture).
    A row with slot -1 writes the same slot and value as the first kept row — a duplicate that changes nothing —
    or, with no row kept, the pool's last slot its own value."""
    slots = slot_mapping.reshape(-1).long()  # [T]
    if slots.numel() == 0:
        return
    keep = slots >= 0  # [T]
    first = keep.int().argmax(0, keepdim=True)  # [1]: the first kept row (0 where none is); indexes by index_select,
    any_kept = keep.any()  # as a 0-d index would be read on the host
    last = torch.full_like(first, k_pool.shape[0] * k_pool.shape[1] - 1)  # [1]
    target = torch.where(keep, slots, torch.where(any_kept, slots.index_select(0, first), last))  # [T]
    heads, head_dim = k_pool.shape[2:]
    for new, pool in ((k, k_pool), (v, v_pool)):
        flat = pool.view(-1, heads, head_dim)  # [num_blocks * block_size, Hkv, D]
        rows = new.reshape(-1, heads, head_dim)  # [T, Hkv, D]
        filler = torch.where(any_kept, rows.index_select(0, first), flat.index_select(0, last))  # [1, Hkv, D]
        flat.index_put_((target,), torch.where(keep[:, None, None], rows, filler))
