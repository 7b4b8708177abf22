"""int4 weight-only matmul (W4A16): ``out = x @ dequant(W)``, fp32 accumulation.

Layout hfaccel repacks every checkpoint format into at load time (see ``hfaccel.quant.formats``):

- ``qweight: [K // 8, N]`` int32, packed along K: row ``k`` of the weight is nibble ``k % 8`` (lowest first)
  of word ``k // 8``;
- ``scales, zeros: [K // group_size, N]`` in the activation dtype (zeros hold the integer zero point);
- ``W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]`` and ``out = x @ W`` (``W`` is ``[K, N]``,
  the transpose of ``nn.Linear.weight``). Activation-order checkpoints are handled by the caller permuting
  ``x``'s columns once (groups are then contiguous).

N is the contiguous axis: a warp reading a row of a tile reads 32 threads x 4 consecutive words, one 128-bit
load per thread and 512 contiguous bytes per warp, and every word a thread loads holds 8 rows of the columns it
owns, so a program streams packed weights without moving them between threads (the test suite checks the
sm_90 code for 128-bit loads and no shared memory in the GEMV). That is why the layout is kept as GPTQ packs it.

Dequantization never converts an integer to a float (a slow instruction on NVIDIA GPUs): :func:`_q_minus_z`
masks each nibble into the mantissa of a float of known exponent (the "magic number" trick Marlin uses in
16 bits), which gives ``q - z`` exactly in two instructions per weight.

Paths, chosen per call by ``hfaccel.kernels.w4a16_config`` (tuned table or heuristics):

- ``gemv``: one row of ``x`` per program; each thread multiplies whole K-tiles of 4 (or 8) columns with fp32
  FMAs — no tensor cores, no padding of M to 16 — and the group scale is applied once per K-tile;
- ``gemm``: tensor-core tiles ``[BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]``; for small M the scale multiplies
  the tile's product (the dequantized ``q - z`` is exact in 16 bits), for large M it multiplies the weights;
- ``dequant``: the weight dequantized once to the activation dtype, then cuBLAS.

On a CPU, :func:`pack_int4_cpu` repacks the same weight once for torch's int4 CPU kernel
(``aten._weight_int4pack_mm_for_cpu``, what torchao and gpt-fast run on CPUs) and :func:`int4pack_matmul` serves
by it; :func:`int4pack_unsupported` says where it cannot (group sizes other than 32/64/128/256, a torch without
the op), and the caller keeps :func:`w4a16_matmul` there.

``gemv`` and ``gemm`` split K across programs when the output tiles alone leave SMs idle
(``hfaccel.kernels.split_k``: fp32 partials added in split order, bit-identical run to run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import interpreting, resolve_backend, triton_can_run
from hfaccel.kernels.split_k import finish, k_slices, partial_out
from hfaccel.kernels.w4a16_config import W4A16Config, fit_config, pick_w4a16_config

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu takes
# The CPU kernel's vectorized path (AVX2 / AVX-512) is bf16's; other activations run scalar code there (fp32: ~19x
# slower than the fp32 dense matmul at 576 x 576, one thread), so every dtype is computed in bf16 and cast back.
INT4PACK_DTYPE = torch.bfloat16
INT4PACK_N_MULTIPLE = 16  # output features the packing takes at once; others are zero-padded


@triton.jit
def _q_minus_z(words, j, zeros):
    """``q - z`` as fp32, exactly, for nibble ``j`` (0..7: an int, or an int tensor broadcast against ``words``)
    of each int32 word, ``zeros`` being the integer zero points as fp32.

    Nibble ``jj = j % 4`` of a 16-bit half sits at bits ``4jj .. 4jj + 3``; OR-ed into a float of exponent
    ``23 - 4jj`` (whose mantissa step at bit ``4jj`` is worth 1) it reads as ``2**(23 - 4jj) + q``. Subtracting
    ``2**(23 - 4jj) + z`` leaves ``q - z``: integers below 2**24, so every step is exact. Nibbles 4..7 are read
    from the word shifted right by 16 (the sign bits the shift brings in are masked off).
    """
    jj = j % 4
    magic = (150 - 4 * jj) << 23  # the bits of the float 2**(23 - 4jj)
    bits = ((words >> (16 * (j // 4))) & (15 << (4 * jj))) | magic
    return bits.to(tl.float32, bitcast=True) - (zeros + tl.cast(magic, tl.float32, bitcast=True))


@triton.jit
def _load_group_row(PTR, group, stride_g, offs_n, n_ok):
    """Row ``group`` of scales or zeros for the columns ``offs_n``, as fp32 ``[BLOCK_N]``."""
    return tl.load(PTR + group * stride_g + offs_n, mask=n_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    X,
    QW,
    SCALES,
    ZEROS,
    OUT,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_os,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program: row pid_m of x times BLOCK_N columns over one K-slice (unit strides along K for x, along N for
    # the rest). Each thread owns whole K-tiles of its columns: products are summed in its registers.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Scales, zeros and outputs are read and written 4 columns per thread, as the words are (16-bit values would
    # otherwise be loaded 8 per thread and moved between threads every iteration).
    offs_4 = tl.max_contiguous(offs_n, 4)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    x_row = X + pid_m * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(
            QW + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0
        )  # [ROWS, BLOCK_N]: rows k0 + 8r .. k0 + 8r + 7
        group = k0 // group_size  # the whole tile: BLOCK_K divides group_size
        zeros = _load_group_row(ZEROS, group, stride_zg, offs_4, n_ok)
        tile = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_row + k0 + offs_r * 8 + j).to(tl.float32)  # [ROWS]: x[k0 + 8r + j]
            tile += xj[:, None] * _q_minus_z(words, j, zeros[None, :])
        acc += tl.sum(tile, 0) * _load_group_row(SCALES, group, stride_sg, offs_4, n_ok)
    if SPLIT:  # this split's fp32 partial
        tl.store(OUT + pid_k * stride_os + pid_m * stride_om + offs_4, acc, mask=n_ok)
    else:
        tl.store(OUT + pid_m * stride_om + offs_4, acc.to(OUT.dtype.element_ty), mask=n_ok)


@triton.jit
def _dot(x, w, F32_DOT: tl.constexpr):
    """``x @ w`` accumulated in fp32: IEEE fp32 products for ``F32_DOT`` (fp32 activations; bf16 in the
    interpreter, whose bf16 arithmetic is broken), else tensor cores on ``w`` rounded to x's dtype."""
    if F32_DOT:
        out = tl.dot(x.to(tl.float32), w, input_precision="ieee")
    else:
        out = tl.dot(x, w.to(x.dtype))
    return out


@triton.jit
def _gemm_kernel(
    X,
    QW,
    SCALES,
    ZEROS,
    OUT,
    M,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # Program: a [BLOCK_M, BLOCK_N] output tile over one K-slice (unit strides along K for x, along N for
    # the rest); programs that share weight tiles (same pid_n) are adjacent in launch order.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_K // 8)
    nibble = tl.arange(0, 8)[None, :, None]
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(
            QW + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0
        )  # [BLOCK_K / 8, BLOCK_N]
        group = k0 // group_size  # the whole tile: BLOCK_K divides group_size
        zeros = _load_group_row(ZEROS, group, stride_zg, offs_n, n_ok)
        scales = _load_group_row(SCALES, group, stride_sg, offs_n, n_ok)
        q = tl.reshape(
            _q_minus_z(words[:, None, :], nibble, zeros[None, None, :]), (BLOCK_K, BLOCK_N)
        )  # [BLOCK_K, BLOCK_N]: row 8r + j from nibble j of word row r, exact
        if SCALE_AFTER:
            acc += _dot(x, q, F32_DOT) * scales[None, :]
        else:
            acc += _dot(x, q * scales[None, :], F32_DOT)
    out_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT:  # this split's fp32 partial
        tl.store(out_ptrs + pid_k * stride_os, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(
    QW,
    SCALES,
    ZEROS,
    W,
    N,
    group_size,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_wk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program: rows [k0, k0 + BLOCK_K) x BLOCK_N columns of W = (q - z) * s, in W's dtype.
    k0 = tl.program_id(0) * BLOCK_K
    offs_r = tl.arange(0, BLOCK_K // 8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    words = tl.load(QW + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0)
    group = k0 // group_size
    zeros = _load_group_row(ZEROS, group, stride_zg, offs_n, n_ok)
    scales = _load_group_row(SCALES, group, stride_sg, offs_n, n_ok)
    for j in tl.static_range(8):
        w = _q_minus_z(words, j, zeros[None, :]) * scales[None, :]
        tl.store(
            W + (k0 + offs_r * 8 + j)[:, None] * stride_wk + offs_n[None, :],
            w.to(W.dtype.element_ty),
            mask=n_ok[None, :],
        )


def _check(x, qweight, scales, zeros, group_size):
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES}; got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    k = x.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * 8 != k:
        raise ValueError(
            f"qweight must be int32 [K/8={k // 8}, N] for K={k}; got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if group_size < 8 or group_size % 8 or k % group_size:
        raise ValueError(f"group_size must be a multiple of 8 that divides K={k}; got {group_size}")
    expected = (k // group_size, qweight.shape[1])
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != expected or t.dtype != x.dtype:
            raise ValueError(f"{name} must be {x.dtype} {expected}; got {t.dtype} {tuple(t.shape)}")
    if len({x.device, qweight.device, scales.device, zeros.device}) != 1:
        raise ValueError("x, qweight, scales and zeros must be on one device")


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    *,
    backend: str = "auto",
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """``x: [M, K]`` times the int4 weight ``[K, N]`` (layout in the module docstring); returns ``[M, N]``.

    ``config`` forces a path and its tiles (``hfaccel tune``, benchmarks, tests; fitted to the shape); by default
    :func:`~hfaccel.kernels.w4a16_config.pick_w4a16_config` chooses from the GPU's tuned table or heuristics.
    """
    _check(x, qweight, scales, zeros, group_size)
    if resolve_backend(backend, x.device) == "torch":
        return w4a16_reference(x, qweight, scales, zeros, group_size)
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return x.new_empty(0, n)
    cfg = (
        fit_config(config, m, n, k, group_size)
        if config is not None
        else pick_w4a16_config(m, n, k, x.dtype, group_size, x.device)
    )
    x, qweight, scales, zeros = (t.contiguous() for t in (x, qweight, scales, zeros))
    if cfg.path == "dequant":
        return x @ dequantize_weight(qweight, scales, zeros, group_size, x.dtype, cfg)
    return _tiled(x, qweight, scales, zeros, group_size, cfg)


def _tiled(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, cfg: W4A16Config
) -> torch.Tensor:
    """The gemv or gemm path; with ``split_k > 1`` their fp32 partials, then their ordered sum."""
    m, k = x.shape
    n = qweight.shape[1]
    k_per_split, split = k_slices(k, cfg.split_k, cfg.block_k)
    out = partial_out(split, m, n, x)  # [S, M, N]
    args = (x, qweight, scales, zeros, out)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), out.stride(1))
    if cfg.path == "gemv":
        _gemv_kernel[(m, triton.cdiv(n, cfg.block_n), split)](
            *args,
            n,
            k,
            group_size,
            k_per_split,
            *strides,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT=split > 1,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    else:
        _gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)](
            *args,
            m,
            n,
            k,
            group_size,
            k_per_split,
            *strides,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT=split > 1,
            SCALE_AFTER=cfg.block_m < cfg.block_k,
            F32_DOT=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting() and not x.is_cuda),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return finish(out, x.dtype)


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """The ``[K, N]`` weight in ``dtype`` (each element ``(q - z) * s`` rounded once), by the Triton kernel of the
    ``dequant`` path (tiles from ``config``, default 64 x 128)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    cfg = fit_config(config or W4A16Config("dequant", block_n=128, block_k=64), 1, n, k, group_size)
    w = torch.empty(k, n, device=qweight.device, dtype=dtype)
    _dequantize_kernel[(k // cfg.block_k, triton.cdiv(n, cfg.block_n))](
        qweight,
        scales,
        zeros,
        w,
        n,
        group_size,
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        w.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    return w


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """``[K/8, N]`` int32 packed along K → ``[K, N]`` int32 values 0..15."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)  # nibble j at bits 4j
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    return q.reshape(-1, qweight.shape[1])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The ``[K, N]`` weight in fp32 that the kernel multiplies by."""
    q = unpack_rows(qweight).float()
    s = scales.float().repeat_interleave(group_size, 0)
    z = zeros.float().repeat_interleave(group_size, 0)
    return (q - z) * s


def w4a16_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Pure-torch definition of :func:`w4a16_matmul`: dequantize, then an fp32 matmul."""
    return (x.float() @ dequantize(qweight, scales, zeros, group_size)).to(x.dtype)


@dataclass(frozen=True)
class Int4Pack:
    """An int4 weight in the layout of torch's CPU kernel (:func:`pack_int4_cpu`)."""

    weight: torch.Tensor  # [N_pad, K / 2] uint8: aten._convert_weight_to_int4pack_for_cpu of the codes [N_pad, K]
    scales_and_zeros: torch.Tensor  # [K / g, N_pad, 2] bf16: (scale, zero) with W = (q - 8) * scale + zero
    group_size: int
    out_features: int  # N (the padded columns past it are zeros)


def int4pack_device(device: torch.device | str) -> bool:
    """Whether ``device`` is one torch's CPU int4 kernel serves: a CPU where Triton cannot run (under
    ``TRITON_INTERPRET=1`` the interpreted Triton kernels serve instead, as everywhere else)."""
    return torch.device(device).type == "cpu" and not triton_can_run(device)


def int4pack_unsupported(group_size: int) -> str | None:
    """Why torch's CPU int4 kernel cannot serve a weight of ``group_size``, or None where it can."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu (torch >= 2.6 has)"
    if group_size not in INT4PACK_GROUP_SIZES:
        return f"group_size {group_size} is not one of the CPU kernel's {INT4PACK_GROUP_SIZES}"
    return None


def int4pack_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """hfaccel's ``scales, zeros [K/g, N]`` (``W = (q - z) * s``, ``z`` the integer zero point) as the CPU kernel's
    ``[K/g, N, 2]`` (scale, zero) pairs, whose rule is ``W = (q - 8) * scale + zero``: the same ``W`` when
    ``zero = (8 - z) * s`` (computed in fp32, rounded once to bf16)."""
    s = scales.float()
    return torch.stack([s, (8 - zeros.float()) * s], dim=-1).to(INT4PACK_DTYPE)


def pack_int4_cpu(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Pack:
    """Repack ``qweight [K/8, N]`` int32 (nibbles along K) and its ``scales, zeros [K/g, N]`` for
    :func:`int4pack_matmul` (once per weight; ``N`` zero-padded to a multiple of 16)."""
    reason = int4pack_unsupported(group_size)
    if reason is not None:
        raise ValueError(f"the CPU int4 kernel cannot take this weight: {reason}")
    n = qweight.shape[1]
    pad = -n % INT4PACK_N_MULTIPLE
    codes = torch.nn.functional.pad(unpack_rows(qweight).t(), (0, 0, 0, pad))  # [N_pad, K] int32 0..15
    pairs = torch.nn.functional.pad(int4pack_scales_and_zeros(scales, zeros), (0, 0, 0, pad))  # [K/g, N_pad, 2]
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # innerKTiles: unused on CPU
    return Int4Pack(weight, pairs.contiguous(), group_size, n)


def int4pack_matmul(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """``x [M, K]`` (a CPU tensor) times the packed weight ``[K, N]`` by torch's CPU int4 kernel -> ``[M, N]`` in
    ``x``'s dtype; computed in bf16 (x rounded to bf16, fp32 accumulation inside the kernel)."""
    rows = x.to(INT4PACK_DTYPE).contiguous()  # [M, K]: the kernel takes contiguous rows only
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, pack.weight, pack.group_size, pack.scales_and_zeros)
    return out[:, : pack.out_features].to(x.dtype)  # [M, N_pad] -> [M, N]
