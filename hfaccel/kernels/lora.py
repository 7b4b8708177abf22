"""Batched multi-LoRA (Punica / vLLM style): every token row of a packed batch takes its own adapter from a pool of
slots, in two kernels around the base layer's matmul.

- ``shrink``: ``v[t] = x[t] @ a[index[t]].T`` — ``x [T, K]``, the pool of A matrices ``a [S, R, K]`` (each slot's
  rank zero-padded to R) -> ``v [T, R]`` float32;
- ``expand``: ``out[t] = y[t] + v[t] @ b[index[t]].T`` — the base output ``y [T, N]``, the pool of B matrices
  ``b [S, N, R]`` (the LoRA scaling folded in) -> a new ``[T, N]`` in ``y``'s dtype, computed in fp32 and rounded
  once.

- ``apply``: ``out[t] = y[t] + (x[t] @ a[index[t]].T) @ b[index[t]].T`` — both in one call, what a LoRA layer runs:
  for a decode step's rows (at most ``FUSED_MAX_ROWS``) one fused kernel, v kept in registers; beyond (a
  prefill), shrink then expand.

``index [T]`` (int32 or int64, on the device) is the slot of each row; a row whose index is -1 (any value outside
``[0, S)``) takes no adapter: ``v`` is 0 there and ``out`` is ``y``'s row, bit for bit. No call reads the index on
the host, so every call can be captured in a CUDA graph.

The kernels are BGMV-style: a program takes a tile of token rows and gathers, row by row, the weights of the row's
own slot (a tile may mix adapters), multiplying on CUDA cores with fp32 accumulation — no sorting of the tokens by
adapter. ``shrink`` loops over K (split across programs when the row tiles alone leave SMs idle; the fp32 partials
are summed in split order, so results never depend on scheduling) and ``expand`` over R. The fused kernel gives
each row one or more programs over shares of N, each computing the row's whole v first (the same way, so they agree
bit for bit): a decode step pays one launch per LoRA layer instead of three (shrink, the split-K sum, expand), which
cost more than the layer's base matmul while moving under 1 MB (docs/benchmarks.md).

The references loop over the pool's slots with masks (``torch.where``): no host sync and memory O(T*R + T*N).
``slots`` (a host list) may restrict that loop to the slots the caller knows can appear — rows with any other slot
then take no adapter. ``backend="auto"`` runs the kernels on CUDA and the references elsewhere (under
``TRITON_INTERPRET=1`` the interpreted kernels cost far more than the references' few matmuls; the tests run them
with ``backend="triton"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import interpreting, num_sms, resolve_backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUSED_MAX_ROWS = 256  # lora_apply's rows up to which one fused launch serves (every decode batch of the ladder)
INDEX_DTYPES = (torch.int32, torch.int64)
# Elements of a program's [BLOCK_T, BLOCK_R, BLOCK_K] (or [BLOCK_T, BLOCK_N, BLOCK_R]) product tile: 64 fp32 registers
# a thread with 4 warps on a GPU; the interpreter runs fewer, bigger programs (its cost is per program step).
TILE_ELEMENTS = 8192
INTERPRET_TILE_ELEMENTS = 1 << 16


# ---------------------------------------------------------------------------------------------------- references


def _slots(pool_size: int, slots: Sequence[int] | None) -> list[int]:
    """The slots a reference loops over: ``slots`` (those in ``[0, pool_size)``, once each) or the whole pool."""
    if slots is None:
        return list(range(pool_size))
    return sorted({int(s) for s in slots if 0 <= int(s) < pool_size})


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, slots: Sequence[int] | None = None
) -> torch.Tensor:
    """``x [T, K]``, ``a [S, R, K]``, ``index [T]`` -> ``v [T, R]`` float32, ``v[t] = x[t] @ a[index[t]].T`` (0 where
    ``index[t]`` is not a slot — or, given ``slots``, not one of them). One fp32 matmul per slot, kept per row by a
    mask: no host sync, memory O(T*R)."""
    _check_shrink(x, a, index)
    rows, rank = x.shape[0], a.shape[1]
    xf = x.float()  # [T, K]
    v = torch.zeros(rows, rank, dtype=torch.float32, device=x.device)  # [T, R]
    for s in _slots(a.shape[0], slots):
        mine = (index == s)[:, None]  # [T, 1]
        v = torch.where(mine, xf @ a[s].float().T, v)  # [T, K] @ [K, R]
    return v


def lora_expand_reference(
    y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, index: torch.Tensor, slots: Sequence[int] | None = None
) -> torch.Tensor:
    """``y [T, N]``, ``v [T, R]``, ``b [S, N, R]``, ``index [T]`` -> a new ``[T, N]`` in ``y``'s dtype:
    ``y[t] + v[t] @ b[index[t]].T`` computed in fp32 and rounded once; rows whose ``index`` is not a slot (given
    ``slots``, not one of them) are ``y``'s rows, bit for bit. No host sync, memory O(T*N)."""
    _check_expand(y, v, b, index)
    vf = v.float()  # [T, R]
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)  # [T, N]
    used = torch.zeros(y.shape[0], 1, dtype=torch.bool, device=y.device)  # [T, 1]
    for s in _slots(b.shape[0], slots):
        mine = (index == s)[:, None]  # [T, 1]
        delta = torch.where(mine, vf @ b[s].float().T, delta)  # [T, R] @ [R, N]
        used = used | mine
    return torch.where(used, (y.float() + delta).to(y.dtype), y)


# ------------------------------------------------------------------------------------------------------ checks


def _check_index(index: torch.Tensor, rows: int, device: torch.device) -> None:
    if index.dtype not in INDEX_DTYPES or tuple(index.shape) != (rows,):
        raise ValueError(f"index must be int32 or int64 [T={rows}]; got {index.dtype} {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"index must be on {device}; got {index.device}")


def _check_shrink(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor) -> None:
    if x.dtype not in DTYPES or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [T, K] tensor of {DTYPES}; got {x.dtype} {tuple(x.shape)}")
    if a.dtype not in DTYPES or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"a must be [S, R, K={x.shape[1]}] of {DTYPES}; got {a.dtype} {tuple(a.shape)}")
    if a.device != x.device:
        raise ValueError(f"x and a must be on one device; got {x.device} and {a.device}")
    _check_index(index, x.shape[0], x.device)


def _check_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> None:
    _check_shrink(x, a, index)
    if y.dtype not in DTYPES or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must be a 2-D [T={x.shape[0]}, N] tensor of {DTYPES}; got {y.dtype} {tuple(y.shape)}")
    expected = (a.shape[0], y.shape[1], a.shape[1])
    if b.dtype not in DTYPES or tuple(b.shape) != expected:
        raise ValueError(f"b must be [S, N, R] = {list(expected)} of {DTYPES}; got {b.dtype} {tuple(b.shape)}")
    if len({x.device, y.device, b.device}) != 1:
        raise ValueError(f"x, y and b must be on one device; got {x.device}, {y.device}, {b.device}")


def _check_expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> None:
    if y.dtype not in DTYPES or y.dim() != 2:
        raise ValueError(f"y must be a 2-D [T, N] tensor of {DTYPES}; got {y.dtype} {tuple(y.shape)}")
    rows, n = y.shape
    if b.dtype not in DTYPES or b.dim() != 3 or b.shape[1] != n:
        raise ValueError(f"b must be [S, N={n}, R] of {DTYPES}; got {b.dtype} {tuple(b.shape)}")
    if v.dtype not in DTYPES or tuple(v.shape) != (rows, b.shape[2]):
        raise ValueError(f"v must be [T={rows}, R={b.shape[2]}] (float32); got {v.dtype} {tuple(v.shape)}")
    if len({y.device, v.device, b.device}) != 1:
        raise ValueError(f"y, v and b must be on one device; got {y.device}, {v.device}, {b.device}")
    _check_index(index, rows, y.device)


# ----------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_slots(INDEX, offs_t, T, S):
    """The slot of each row of ``offs_t`` as int64 (0 where the row takes none) and whether it takes one."""
    slot = tl.load(INDEX + offs_t, mask=offs_t < T, other=-1).to(tl.int64)
    use = (offs_t < T) & (slot >= 0) & (slot < S)
    return tl.where(use, slot, 0), use


@triton.jit
def _shrink_kernel(
    X,
    A,
    INDEX,
    V,
    T,
    K,
    R,
    S,
    k_per_split,
    stride_xt,
    stride_as,
    stride_ar,
    stride_vs,
    stride_vt,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program: rows [BLOCK_T] x ranks [BLOCK_R] of v over one K-slice (unit strides along K); each row gathers the
    # A rows of its own slot. Rows without a slot load nothing and store 0.
    pid_t = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    slot, use = _row_slots(INDEX, offs_t, T, S)
    r_ok = offs_r < R
    x_rows = X + offs_t[:, None] * stride_xt  # [BLOCK_T, 1]
    a_rows = A + slot[:, None, None] * stride_as + offs_r[None, :, None] * stride_ar  # [BLOCK_T, BLOCK_R, 1]
    a_ok = use[:, None, None] & r_ok[None, :, None]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_end
        x = tl.load(x_rows + kk[None, :], mask=use[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_rows + kk[None, None, :], mask=a_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * a, axis=2)  # [BLOCK_T, BLOCK_R]
    out = V + pid_k * stride_vs + offs_t[:, None] * stride_vt + offs_r[None, :]
    tl.store(out, acc, mask=(offs_t < T)[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    Y,
    VV,
    B,
    INDEX,
    OUT,
    T,
    N,
    S,
    stride_yt,
    stride_vt,
    stride_bs,
    stride_ot,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Program: rows [BLOCK_T] x columns [BLOCK_N] of out (unit strides along N for y and out, along R for v and b);
    # each row gathers the B rows of its own slot. Rows without a slot copy y's values unchanged. The pool's rank R
    # is a constant (one per pool): b's row stride is known, and with BLOCK_R | R the loads along R are unmasked
    # (vectorised) — e.g. R = 8 in fp16, one 128-bit load per row.
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    slot, use = _row_slots(INDEX, offs_t, T, S)
    n_ok = offs_n < N
    b_rows = B + slot[:, None, None] * stride_bs + offs_n[None, :, None] * R  # [BLOCK_T, BLOCK_N, 1]
    b_ok = use[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + offs_r
        if R % BLOCK_R == 0:
            r_ok = tl.full([BLOCK_R], 1, tl.int1)
        else:
            r_ok = rr < R
        v = tl.load(VV + offs_t[:, None] * stride_vt + rr[None, :], mask=use[:, None] & r_ok[None, :], other=0.0).to(
            tl.float32
        )  # [BLOCK_T, BLOCK_R]
        b = tl.load(b_rows + rr[None, None, :], mask=b_ok & r_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(v[:, None, :] * b, axis=2)  # [BLOCK_T, BLOCK_N]
    tile_ok = (offs_t < T)[:, None] & n_ok[None, :]
    y = tl.load(Y + offs_t[:, None] * stride_yt + offs_n[None, :], mask=tile_ok, other=0.0)
    out = tl.where(use[:, None], (y.to(tl.float32) + acc).to(y.dtype), y)
    tl.store(OUT + offs_t[:, None] * stride_ot + offs_n[None, :], out, mask=tile_ok)


@triton.jit
def _fused_kernel(
    X,
    A,
    B,
    Y,
    INDEX,
    OUT,
    K,
    N,
    S,
    n_per_program,
    stride_xt,
    stride_as,
    stride_ar,
    stride_bs,
    stride_yt,
    stride_ot,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program: one row, columns [pid_n * n_per_program, +n_per_program) of out. v = x @ A[slot].T over the whole of K
    # (fp32 products accumulated elementwise, one reduction at the end: every program of the row gets the same v),
    # then y + v @ B[slot].T over the program's columns. A row without a slot loads no weights and copies y's values
    # (its x, read all the same, may hold anything: its v is dropped).
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(INDEX + row).to(tl.int64)
    use = (slot >= 0) & (slot < S)
    slot = tl.where(use, slot, 0)
    ranks = tl.where(use, R, 0)  # the ranks this row reads: all or none (masks compare vectors with it)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ranks
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = A + slot * stride_as + offs_r[:, None] * stride_ar  # [BLOCK_R, 1]
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(X + row * stride_xt + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]  # [BLOCK_R, BLOCK_K]
    v = tl.sum(acc, axis=1)  # [BLOCK_R]
    offs_n = tl.arange(0, BLOCK_N)
    n_start = pid_n * n_per_program
    n_end = tl.minimum(N, n_start + n_per_program)
    for n0 in range(n_start, n_end, BLOCK_N):
        nn = n0 + offs_n
        n_ok = nn < n_end
        b = tl.load(
            B + slot * stride_bs + nn[:, None] * R + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        delta = tl.sum(b * v[None, :], axis=1)  # [BLOCK_N]
        y = tl.load(Y + row * stride_yt + nn, mask=n_ok, other=0.0)
        out = tl.where(nn < tl.where(use, N, 0), (y.to(tl.float32) + delta).to(y.dtype), y)
        tl.store(OUT + row * stride_ot + nn, out, mask=n_ok)


# --------------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class LoraBlocks:
    """A launch of the shrink or expand kernel: the token tile, the reduced axis' block (``block_k`` of shrink, the
    rank block of expand), the other output axis' block (ranks of shrink, columns of expand), and shrink's K
    split."""

    block_t: int
    block_out: int  # shrink: BLOCK_R; expand: BLOCK_N
    block_red: int  # shrink: BLOCK_K; expand: BLOCK_R
    split_k: int = 1
    num_warps: int = 4


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _budget(device: torch.device) -> int:
    return TILE_ELEMENTS if device.type == "cuda" or not interpreting() else INTERPRET_TILE_ELEMENTS


def shrink_blocks(rows: int, rank: int, k: int, device: torch.device | str) -> LoraBlocks:
    """The shrink launch for ``[rows, k] -> [rows, rank]``: tiles within the register budget, and K split across
    programs (GPU only) until about one program per SM."""
    device = torch.device(device)
    budget = _budget(device)
    block_r = min(_pow2(rank), 64)
    block_t = min(_pow2(rows), 16 if device.type == "cuda" else 32)
    while block_t > 1 and block_t * block_r * 16 > budget:
        block_t //= 2
    block_k = min(_pow2(k), 256, max(16, budget // (block_t * block_r)))
    split = 1
    if device.type == "cuda":
        programs = triton.cdiv(rows, block_t) * triton.cdiv(rank, block_r)
        split = max(1, min(triton.cdiv(k, block_k), num_sms(device) // programs))
    return LoraBlocks(block_t, block_r, block_k, split)


def expand_blocks(rows: int, n: int, rank: int, device: torch.device | str) -> LoraBlocks:
    """The expand launch for ``[rows, rank] -> [rows, n]``: tiles within the register budget."""
    device = torch.device(device)
    budget = _budget(device)
    block_r = min(_pow2(rank), 32)
    block_t = min(_pow2(rows), 16 if device.type == "cuda" else 32)
    while block_t > 1 and block_t * block_r * 32 > budget:
        block_t //= 2
    block_n = min(_pow2(n), 256, max(32, budget // (block_t * block_r)))
    return LoraBlocks(block_t, block_n, block_r)


@dataclass(frozen=True)
class FusedBlocks:
    """A launch of the fused kernel: its K and N blocks (the rank is one block) and programs per row."""

    block_k: int
    block_n: int
    programs_per_row: int = 1
    num_warps: int = 8


def fused_blocks(rows: int, n: int, rank: int, k: int, device: torch.device | str) -> FusedBlocks:
    """The fused launch for ``rows`` rows of ``[k] -> [rank] -> [n]``: ``[R, BLOCK_K]`` and ``[BLOCK_N, R]`` tiles of
    twice the register budget (8 warps), and on a GPU each row's columns shared by enough programs to give every SM
    about two (each recomputes its row's v: ``R * K`` products, read from L2)."""
    device = torch.device(device)
    budget = 2 * _budget(device)
    block_r = _pow2(rank)
    block_k = max(16, min(_pow2(k), budget // block_r))
    block_n = max(16, min(_pow2(n), budget // block_r))
    programs = 1
    if device.type == "cuda":
        programs = max(1, min(triton.cdiv(n, block_n), triton.cdiv(2 * num_sms(device), max(rows, 1))))
    return FusedBlocks(block_k, block_n, programs)


def _fused_triton(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, cfg: FusedBlocks
) -> torch.Tensor:
    """The fused kernel's launch: a new ``[T, N]`` in ``y``'s dtype."""
    (rows, k), n = x.shape, y.shape[1]
    pool, rank = a.shape[0], a.shape[1]
    x, y, a, b, index = x.contiguous(), y.contiguous(), a.contiguous(), b.contiguous(), index.contiguous()
    out = torch.empty_like(y)
    n_per_program = triton.cdiv(triton.cdiv(n, cfg.programs_per_row), cfg.block_n) * cfg.block_n
    grid = (rows, triton.cdiv(n, n_per_program))
    _fused_kernel[grid](
        x,
        a,
        b,
        y,
        index,
        out,
        k,
        n,
        pool,
        n_per_program,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        y.stride(0),
        out.stride(0),
        R=rank,
        BLOCK_R=_pow2(rank),
        BLOCK_K=cfg.block_k,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return out


def _shrink_triton(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, cfg: LoraBlocks) -> torch.Tensor:
    """The shrink kernel's launch (and, split, the ordered sum of its fp32 partials ``[split, T, R]``)."""
    rows, k = x.shape
    pool, rank = a.shape[0], a.shape[1]
    x, a, index = x.contiguous(), a.contiguous(), index.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_red) * cfg.block_red
    split = triton.cdiv(k, k_per_split)
    v = torch.empty(split, rows, rank, dtype=torch.float32, device=x.device)  # [split, T, R]
    grid = (triton.cdiv(rows, cfg.block_t), triton.cdiv(rank, cfg.block_out), split)
    _shrink_kernel[grid](
        x,
        a,
        index,
        v,
        rows,
        k,
        rank,
        pool,
        k_per_split,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        v.stride(0),
        v.stride(1),
        BLOCK_T=cfg.block_t,
        BLOCK_R=cfg.block_out,
        BLOCK_K=cfg.block_red,
        num_warps=cfg.num_warps,
    )
    return v[0] if split == 1 else v.sum(0)


def _expand_triton(
    y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, index: torch.Tensor, cfg: LoraBlocks
) -> torch.Tensor:
    """The expand kernel's launch: a new ``[T, N]`` in ``y``'s dtype."""
    rows, n = y.shape
    pool, rank = b.shape[0], b.shape[2]
    y, v, b, index = y.contiguous(), v.contiguous(), b.contiguous(), index.contiguous()
    out = torch.empty_like(y)
    grid = (triton.cdiv(rows, cfg.block_t), triton.cdiv(n, cfg.block_out))
    _expand_kernel[grid](
        y,
        v,
        b,
        index,
        out,
        rows,
        n,
        pool,
        y.stride(0),
        v.stride(0),
        b.stride(0),
        out.stride(0),
        R=rank,
        BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_out,
        BLOCK_R=cfg.block_red,
        num_warps=cfg.num_warps,
    )
    return out


def _choose(backend: str, device: torch.device) -> str:
    """``auto``: the kernel on CUDA, the reference elsewhere; ``triton`` / ``torch`` as asked (``resolve_backend``)."""
    return resolve_backend(backend, device) if backend != "auto" or device.type == "cuda" else "torch"


# ------------------------------------------------------------------------------------------------- public API


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    index: torch.Tensor,
    *,
    slots: Sequence[int] | None = None,
    backend: str = "auto",
    config: LoraBlocks | None = None,
) -> torch.Tensor:
    """``x [T, K]`` (fp32/fp16/bf16) through each row's adapter A, ``a [S, R, K]``, by ``index [T]`` (int32/int64
    on x's device; -1 = no adapter) -> ``v [T, R]`` float32: ``x[t] @ a[index[t]].T``, 0 for rows with no adapter;
    fp32 accumulation. ``slots``: the slots that may appear (a host hint the reference loops over; the kernel
    ignores it). ``backend``: ``auto`` (the kernel on CUDA), ``triton`` or ``torch``; ``config`` forces the
    kernel's tiles (tests, benchmarks)."""
    _check_shrink(x, a, index)
    if _choose(backend, x.device) == "torch":
        return lora_shrink_reference(x, a, index, slots)
    rows, k = x.shape
    rank = a.shape[1]
    if rows == 0 or rank == 0 or k == 0 or a.shape[0] == 0:
        return torch.zeros(rows, rank, dtype=torch.float32, device=x.device)
    return _shrink_triton(x, a, index, config or shrink_blocks(rows, rank, k, x.device))


def lora_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    *,
    slots: Sequence[int] | None = None,
    backend: str = "auto",
    config: LoraBlocks | None = None,
) -> torch.Tensor:
    """The base output ``y [T, N]`` plus each row's adapter B, ``b [S, N, R]`` (scaling folded in), applied to
    ``v [T, R]`` (float32, :func:`lora_shrink`'s output) by ``index [T]`` -> a new ``[T, N]`` in ``y``'s dtype:
    ``y[t] + v[t] @ b[index[t]].T`` in fp32, rounded once; rows with index -1 are ``y``'s, bit for bit.
    ``slots``, ``backend`` and ``config`` as in :func:`lora_shrink`."""
    _check_expand(y, v, b, index)
    if _choose(backend, y.device) == "torch":
        return lora_expand_reference(y, v, b, index, slots)
    rows, n = y.shape
    rank = b.shape[2]
    if rows == 0 or n == 0 or rank == 0 or b.shape[0] == 0:
        return y.clone(memory_format=torch.contiguous_format)
    return _expand_triton(y, v, b, index, config or expand_blocks(rows, n, rank, y.device))


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    index: torch.Tensor,
    *,
    slots: Sequence[int] | None = None,
    backend: str = "auto",
    config: FusedBlocks | None = None,
) -> torch.Tensor:
    """A LoRA layer's whole adapter term: the base output ``y [T, N]`` plus, per row, ``x [T, K]`` through its
    adapter's A (``a [S, R, K]``) and B (``b [S, N, R]``, scaling folded in), by ``index [T]`` (-1: none) -> a new
    ``[T, N]`` in ``y``'s dtype, v in fp32 and the output rounded once; rows with no adapter are ``y``'s, bit for
    bit. ``lora_expand(y, lora_shrink(x, a, index), b, index)`` in one call: with the kernels, rows up to
    ``FUSED_MAX_ROWS`` (a decode step) in one fused launch, more (a prefill) as shrink then expand. ``slots`` and
    ``backend`` as in :func:`lora_shrink`; ``config`` forces the fused kernel and its blocks (tests, benchmarks)."""
    _check_apply(x, y, a, b, index)
    if _choose(backend, x.device) == "torch":
        return lora_expand_reference(y, lora_shrink_reference(x, a, index, slots), b, index, slots)
    rows, k = x.shape
    n, pool, rank = y.shape[1], a.shape[0], a.shape[1]
    if (rows > FUSED_MAX_ROWS and config is None) or 0 in (rows, k, n, pool, rank):
        v = lora_shrink(x, a, index, slots=slots, backend=backend)
        return lora_expand(y, v, b, index, slots=slots, backend=backend)
    return _fused_triton(x, y, a, b, index, config or fused_blocks(rows, n, rank, k, x.device))
