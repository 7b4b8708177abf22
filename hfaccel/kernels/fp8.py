"""fp8 weight-only matmul (W8A16): ``out = x @ dequant(W)``, the weight stored in float8 e4m3, fp32 accumulation.

Layout every fp8 checkpoint format is read into (``hfaccel.quant.fp8``):

- ``weight: [K, N]`` ``torch.float8_e4m3fn`` — the transpose of ``nn.Linear.weight``, N contiguous, so a warp
  reading a row of a tile streams contiguous bytes (half those of a 16-bit weight);
- ``scales: [ceil(K / group_k), ceil(N / group_n)]`` fp32, ``W[k, n] = weight[k, n] * scales[k // group_k,
  n // group_n]``: per output channel is ``group_k = K, group_n = 1`` (compressed-tensors ``FP8-dynamic``, FBGEMM),
  a 128×128 block is ``group_k = group_n = 128`` (block FP8, ``weight_scale_inv`` transposed), per tensor
  ``group_k = K, group_n = N``.

Paths, chosen per call by shape (:func:`pick_path`):

- ``gemv``: one row of ``x`` per program, ``BLOCK_N`` columns, K in tiles: fp32 FMAs, no tensor cores, no padding of
  M to 16 (decode, M of a few rows);
- ``gemm``: tensor-core tiles ``[BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]`` with the weight tile converted to the
  activation dtype, each K tile's product scaled by its group's scales (a K tile never spans two K groups);
- ``dequant``: the weight dequantized once to the activation dtype, then the dense matmul (large M).

Neither kernel ever converts activations to fp8: the math is 16-bit (fp32 for fp32 activations), what halves is the
weight's bytes — where decode's time goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import interpreting, resolve_backend, triton_can_run

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PATHS = ("gemv", "gemm", "dequant")
GEMV_MAX_M = 8  # rows of x served by the GEMV (decode and small batches)
DEQUANT_MIN_M = 1024  # from this many rows the dense matmul of the dequantized weight is served


@dataclass(frozen=True)
class Fp8Config:
    """One path and its tiles."""

    path: str
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4


@triton.jit
def _gemv_kernel(
    X, W, S, OUT,
    N, K, group_k, group_n,
    stride_xm, stride_wk, stride_sk, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program: row pid_m of x times BLOCK_N columns; each K tile lies in one K group (BLOCK_K divides group_k, or
    # there is one group), its partial sum scaled by that group's row of scales.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + pid_m * stride_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(W + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        scale = tl.load(S + (k0 // group_k) * stride_sk + offs_n // group_n, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += tl.sum(x[:, None] * w, 0) * scale
    tl.store(OUT + pid_m * stride_om + offs_n, acc.to(OUT.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemm_kernel(
    X, W, S, OUT,
    M, N, K, group_k, group_n,
    stride_xm, stride_wk, stride_sk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Program: a [BLOCK_M, BLOCK_N] output tile; each K tile's product (the fp8 weights converted to the activation
    # dtype, exactly) scaled by its K group's scales. F32_DOT: fp32 operands (fp32 activations, or bf16 in the
    # interpreter, which cannot compute in bf16).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(W + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N] fp8
        if F32_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        scale = tl.load(S + (k0 // group_k) * stride_sk + offs_n // group_n, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += part * scale[None, :]
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def dequantize(weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``[K, N]`` in ``dtype``: each fp8 value times its group's scale (computed in fp32)."""
    k, n = weight.shape
    expanded = scales.repeat_interleave(group_k, 0)[:k].repeat_interleave(group_n, 1)[:, :n]  # [K, N]
    return (weight.to(torch.float32) * expanded).to(dtype)


def fp8_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int,
                  group_n: int) -> torch.Tensor:
    """``x [M, K] @ dequant(weight) -> [M, N]`` in torch: the dequantized weight in fp32, the product cast back."""
    return (x.to(torch.float32) @ dequantize(weight, scales, group_k, group_n)).to(x.dtype)


def pick_path(m: int) -> str:
    """The path for ``m`` rows of activations."""
    if m <= GEMV_MAX_M:
        return "gemv"
    return "gemm" if m < DEQUANT_MIN_M else "dequant"


def _block_k(k: int, group_k: int) -> int:
    """A K tile that never spans two K groups: at most 64, a power of two dividing ``group_k`` (any, one group)."""
    if group_k >= k:
        return 64
    block = 64
    while group_k % block:
        block //= 2
    if block < 16:
        raise ValueError(f"fp8 K groups of {group_k} are not a multiple of 16 (the kernels' smallest K tile)")
    return block


def fp8_kernels_run(device: torch.device | str) -> bool:
    """Whether the fp8 kernels run on ``device``: a CUDA GPU that converts e4m3 (sm_89 and later: Ada, Hopper,
    Blackwell), or the CPU under the Triton interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return triton_can_run(device)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int, *,
               backend: str = "auto", path: str | None = None) -> torch.Tensor:
    """``x: [M, K]`` times the fp8 weight ``[K, N]`` (layout in the module docstring); returns ``[M, N]`` in
    ``x``'s dtype. ``path`` forces one of :data:`PATHS` (tests, benchmarks); by default :func:`pick_path`."""
    _check(x, weight, scales, group_k, group_n)
    if resolve_backend(backend, x.device) == "torch":
        return fp8_reference(x, weight, scales, group_k, group_n)
    m, k = x.shape
    n = weight.shape[1]
    path = path or pick_path(m)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}; got {path!r}")
    if m == 0:
        return x.new_empty(0, n)
    x, weight, scales = x.contiguous(), weight.contiguous(), scales.contiguous()
    if path == "dequant":
        return x @ dequantize(weight, scales, group_k, group_n, x.dtype)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_k = _block_k(k, group_k)
    strides = (x.stride(0), weight.stride(0), scales.stride(0), out.stride(0))
    if path == "gemv":
        cfg = Fp8Config("gemv", block_n=64, block_k=block_k)
        _gemv_kernel[(m, triton.cdiv(n, cfg.block_n))](x, weight, scales, out, n, k, group_k, group_n, *strides,
                                                        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                                        num_warps=cfg.num_warps)
    else:
        cfg = Fp8Config("gemm", block_m=16 if m <= 16 else 64, block_n=64, block_k=block_k)
        f32_dot = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting() and not x.is_cuda)
        _gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
            x, weight, scales, out, m, n, k, group_k, group_n, *strides, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, F32_DOT=f32_dot, num_warps=cfg.num_warps)
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"fp8_matmul takes x [M, K] and weight [K, N]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"the fp8 weight must be {FP8_DTYPE}; got {weight.dtype}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be one of {ACTIVATION_DTYPES}; got {x.dtype}")
    k, n = weight.shape
    groups = (-(-k // group_k), -(-n // group_n))
    if group_k < 1 or group_n < 1 or tuple(scales.shape) != groups or scales.dtype != torch.float32:
        raise ValueError(f"scales must be fp32 [ceil(K / group_k), ceil(N / group_n)] = {list(groups)} for groups "
                         f"of {group_k} x {group_n}; got {scales.dtype} {list(scales.shape)}")
