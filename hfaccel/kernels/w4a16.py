"""int4 weight-only matmul (W4A16): ``out = x @ dequant(W)``, fp32 accumulation.

Layout hfaccel repacks every checkpoint format into at load time (see ``hfaccel.quant.formats``):

- ``qweight: [K // 8, N]`` int32, packed along K: row ``k`` of the weight is nibble ``k % 8`` (lowest first)
  of word ``k // 8`` — a K-tile of the kernel unpacks with one shift per row;
- ``scales, zeros: [K // group_size, N]`` in the activation dtype (zeros hold the integer zero point);
- ``W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]`` and ``out = x @ W`` (``W`` is ``[K, N]``,
  the transpose of ``nn.Linear.weight``). Activation-order checkpoints are handled by the caller permuting
  ``x``'s columns once (groups are then contiguous).

Paths: a tiled GEMM for prefill-sized M, and for decode-sized M (1–16) a split-K GEMV whose K-slices run in
parallel programs and are summed in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import interpreting, resolve_backend

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMV_MAX_M = 16


@triton.jit
def _w4a16_kernel(
    X, QW, SCALES, ZEROS, OUT,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # Program: a [BLOCK_M, BLOCK_N] output tile over one K-slice (the whole K unless split).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(QW + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_w * 8 < k_end)[:, None] & n_ok[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N]
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = offs_k // group_size
        s = tl.load(SCALES + group[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        z = tl.load(ZEROS + group[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        w = ((q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        if IEEE_FP32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out_ptrs = OUT + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


def pick_w4a16_config(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, split_k) for an ``[m, k] @ [k, n]`` product.

    Shared memory (3 stages of the x tile and the dequantized w tile) stays under sm_90's 227 KB; fp32
    activations get half-width N tiles.
    """
    if m <= GEMV_MAX_M:
        block_n, block_k = 64, 128
        tiles = triton.cdiv(n, block_n)
        split_k = max(1, min(k // block_k, triton.cdiv(256, tiles)))  # ~2 waves of programs on an H100
        return 16, block_n, block_k, 4, split_k
    return (64 if m <= 64 else 128), (64 if dtype == torch.float32 else 128), 64, 8, 1


def _check(x, qweight, scales, zeros, group_size):
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES}; got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    k = x.shape[1]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight must be int32 [K/8={k // 8}, N] for K={k}; got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if group_size < 8 or k % group_size:
        raise ValueError(f"group_size must be >= 8 and divide K={k}; got {group_size}")
    expected = (k // group_size, qweight.shape[1])
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != expected or t.dtype != x.dtype:
            raise ValueError(f"{name} must be {x.dtype} {expected}; got {t.dtype} {tuple(t.shape)}")
    if len({x.device, qweight.device, scales.device, zeros.device}) != 1:
        raise ValueError("x, qweight, scales and zeros must be on one device")


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, *, backend: str = "auto") -> torch.Tensor:
    """``x: [M, K]`` times the int4 weight ``[K, N]`` (layout in the module docstring); returns ``[M, N]``."""
    _check(x, qweight, scales, zeros, group_size)
    if resolve_backend(backend, x.device) == "torch":
        return w4a16_reference(x, qweight, scales, zeros, group_size)
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, block_k, num_warps, split_k = pick_w4a16_config(m, n, k, x.dtype)
    block_k = min(block_k, group_size)  # a K-tile never straddles two groups' scales
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, partial, m, n, k, group_size, k_per_split,
        *x.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *partial.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=x.dtype == torch.bfloat16 and interpreting() and not x.is_cuda,
        IEEE_FP32=x.dtype == torch.float32, num_warps=num_warps, num_stages=3,
    )
    return (partial[0] if split_k == 1 else partial.sum(0)).to(x.dtype)


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


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Pure-torch definition of :func:`w4a16_matmul`: dequantize, then an fp32 matmul."""
    return (x.float() @ dequantize(qweight, scales, zeros, group_size)).to(x.dtype)
