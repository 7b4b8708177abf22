"""fp8 matmul: ``out = x @ dequant(W)``, the weight stored in float8 e4m3, fp32 accumulation.

Layout every fp8 checkpoint format is read into (``hfaccel.quant.fp8``):

- ``weight: [K, N]`` ``torch.float8_e4m3fn`` — the transpose of ``nn.Linear.weight``, N contiguous, so a warp
  reading a row of a tile streams contiguous bytes (half those of a 16-bit weight);
- ``scales: [ceil(K / group_k), ceil(N / group_n)]`` fp32, ``W[k, n] = weight[k, n] * scales[k // group_k,
  n // group_n]``: per output channel is ``group_k = K, group_n = 1`` (compressed-tensors ``FP8-dynamic``, FBGEMM),
  a 128×128 block is ``group_k = group_n = 128`` (block FP8, ``weight_scale_inv`` transposed), per tensor
  ``group_k = K, group_n = N``.

Paths (``hfaccel.kernels.fp8_config`` routes each call by shape and the GPU's tuned table):

- ``gemv``: one row of ``x`` per program, ``BLOCK_N`` columns, K in tiles: fp32 FMAs, no tensor cores, no padding of
  M to 16 (decode, M of a few rows);
- ``gemm``: tensor-core tiles ``[BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]`` with the weight tile converted to the
  activation dtype, each K tile's product scaled by its group's scales (a K tile never spans two K groups);
- ``w8a8``: the activations quantized to e4m3 per token (per token and K group for block weights:
  :func:`quantize_activations`), fp8 tensor-core tiles, each K tile's product scaled by both operands' scales;
- ``dequant``: the weight dequantized once to the activation dtype, then the dense matmul (large M).

The tiled paths split K across programs where their tiles alone leave SMs idle (``hfaccel.kernels.split_k``: fp32
partials added in split order, bit-identical run to run). The weight-only paths keep the activations' precision:
what halves is the weight's bytes, where decode's time goes. ``w8a8`` doubles the tensor cores' rate for large M at
the cost of rounding the activations (as vLLM's and transformers' fp8 kernels do); its reference is
:func:`w8a8_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels.fp8_config import PATHS, W8A8_DTYPES, Fp8Config, fit_config, pick_fp8_config
from hfaccel.kernels.runtime import interpreting, resolve_backend, triton_can_run
from hfaccel.kernels.split_k import finish, k_slices, partial_out

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gemv_kernel(
    X,
    W,
    S,
    OUT,
    N,
    K,
    group_k,
    group_n,
    k_per_split,
    stride_xm,
    stride_wk,
    stride_sk,
    stride_os,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program: row pid_m of x times BLOCK_N columns over K slice pid_k; each K tile lies in one K group (BLOCK_K
    # divides group_k, or there is one group), its partial sum scaled by that group's row of scales.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + pid_m * stride_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(
            W + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        scale = tl.load(S + (k0 // group_k) * stride_sk + offs_n // group_n, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += tl.sum(x[:, None] * w, 0) * scale
    if SPLIT:  # this slice's fp32 partial
        tl.store(OUT + pid_k * stride_os + pid_m * stride_om + offs_n, acc, mask=n_ok)
    else:
        tl.store(OUT + pid_m * stride_om + offs_n, acc.to(OUT.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemm_kernel(
    X,
    XS,
    W,
    S,
    OUT,
    M,
    N,
    K,
    group_k,
    group_n,
    k_per_split,
    stride_xm,
    stride_xsm,
    stride_wk,
    stride_sk,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
    W8A8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program: a [BLOCK_M, BLOCK_N] output tile over K slice pid_k; each K tile lies in one K group, its product
    # scaled by that group's weight scales. 16-bit: the fp8 weights converted to the activation dtype (exactly);
    # F32_DOT: fp32 operands (fp32 activations, or bf16 in the interpreter, which cannot compute in bf16). W8A8: X
    # holds e4m3 activations over per-row (and K group) scales XS, fp8 x fp8 products scaled by both.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(
            X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            W + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N] fp8
        group = k0 // group_k
        if W8A8:
            x_scale = tl.load(XS + offs_m * stride_xsm + group, mask=m_ok, other=0.0)  # [BLOCK_M]
            part = tl.dot(x, w) * x_scale[:, None]
        elif F32_DOT:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        scale = tl.load(S + group * stride_sk + offs_n // group_n, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += part * scale[None, :]
    out_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT:  # this slice's fp32 partial
        tl.store(out_ptrs + pid_k * stride_os, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_activations(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as e4m3 ``[M, K]`` over fp32 scales ``[M, ceil(K / group_k)]``: each row's (each row's per K
    group) largest magnitude maps to 448 — dynamic per-token (per-token-group) scaling."""
    m, k = x.shape
    group = min(group_k, k)
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scales = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, G]
    quantized = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8_DTYPE)
    return quantized, scales


def w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int
) -> torch.Tensor:
    """The ``w8a8`` path in torch: ``x`` quantized by :func:`quantize_activations`, both operands dequantized to
    fp32, the product cast back to ``x``'s dtype."""
    quantized, x_scales = quantize_activations(x, group_k)
    group = min(group_k, x.shape[1])
    x_dequantized = quantized.float() * x_scales.repeat_interleave(group, 1)[:, : x.shape[1]]
    return (x_dequantized @ dequantize(weight, scales, group_k, group_n)).to(x.dtype)


def dequantize(
    weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight ``[K, N]`` in ``dtype``: each fp8 value times its group's scale (computed in fp32)."""
    k, n = weight.shape
    expanded = scales.repeat_interleave(group_k, 0)[:k].repeat_interleave(group_n, 1)[:, :n]  # [K, N]
    return (weight.to(torch.float32) * expanded).to(dtype)


def fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight) -> [M, N]`` in torch: the dequantized weight in fp32, the product cast back."""
    return (x.to(torch.float32) @ dequantize(weight, scales, group_k, group_n)).to(x.dtype)


def fp8_kernels_run(device: torch.device | str) -> bool:
    """Whether the fp8 kernels run on ``device``: a CUDA GPU that converts e4m3 (sm_89 and later: Ada, Hopper,
    Blackwell), or the CPU under the Triton interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return triton_can_run(device)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    group_k: int,
    group_n: int,
    *,
    backend: str = "auto",
    path: str | None = None,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """``x: [M, K]`` times the fp8 weight ``[K, N]`` (layout in the module docstring); returns ``[M, N]`` in
    ``x``'s dtype. ``config`` (``hfaccel tune``; fitted to the shape) or ``path`` (one of :data:`PATHS` with default
    tiles: tests, benchmarks) forces a path; by default ``pick_fp8_config`` decides."""
    _check(x, weight, scales, group_k, group_n)
    if resolve_backend(backend, x.device) == "torch":
        return fp8_reference(x, weight, scales, group_k, group_n)
    m, k = x.shape
    n = weight.shape[1]
    if config is not None:
        config = fit_config(config, k, group_k)
    elif path is not None:
        config = _default_config(path, m, k, group_k)
    else:
        config = pick_fp8_config(m, n, k, x.dtype, group_k, group_n, x.device)
    if config.path == "w8a8" and x.dtype not in W8A8_DTYPES:
        raise ValueError(f"the w8a8 path takes {W8A8_DTYPES} activations; got {x.dtype}")
    if m == 0:
        return x.new_empty(0, n)
    x, weight, scales = x.contiguous(), weight.contiguous(), scales.contiguous()
    if config.path == "dequant":
        return x @ dequantize(weight, scales, group_k, group_n, x.dtype)
    k_per_split, splits = k_slices(k, config.split_k, config.block_k)
    out = partial_out(splits, m, n, x)  # [S, M, N]
    tiles = dict(
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT=splits > 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    grid_n = triton.cdiv(n, config.block_n)
    if config.path == "gemv":
        _gemv_kernel[(m, grid_n, splits)](
            x,
            weight,
            scales,
            out,
            n,
            k,
            group_k,
            group_n,
            k_per_split,
            x.stride(0),
            weight.stride(0),
            scales.stride(0),
            out.stride(0),
            out.stride(1),
            **tiles,
        )
    else:
        operand, x_scales = x, scales  # scales: a placeholder pointer, read only by w8a8
        if config.path == "w8a8":
            operand, x_scales = quantize_activations(x, group_k)
        f32_dot = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting() and not x.is_cuda)
        _gemm_kernel[(triton.cdiv(m, config.block_m), grid_n, splits)](
            operand,
            x_scales,
            weight,
            scales,
            out,
            m,
            n,
            k,
            group_k,
            group_n,
            k_per_split,
            operand.stride(0),
            x_scales.stride(0),
            weight.stride(0),
            scales.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_M=config.block_m,
            F32_DOT=f32_dot,
            W8A8=config.path == "w8a8",
            **tiles,
        )
    return finish(out, x.dtype)


def _default_config(path: str, m: int, k: int, group_k: int) -> Fp8Config:
    """A forced ``path``'s tiles: the heuristics' sizes for ``m`` rows."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}; got {path!r}")
    rows = 16 if m <= 16 else 64
    return fit_config(Fp8Config(path, block_m=rows, block_n=64, block_k=64), k, group_k)


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_k: int, group_n: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"fp8_matmul takes x [M, K] and weight [K, N]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"the fp8 weight must be {FP8_DTYPE}; got {weight.dtype}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be one of {ACTIVATION_DTYPES}; got {x.dtype}")
    k, n = weight.shape
    groups = (-(-k // group_k), -(-n // group_n))
    if group_k < 1 or group_n < 1 or tuple(scales.shape) != groups or scales.dtype != torch.float32:
        raise ValueError(
            f"scales must be fp32 [ceil(K / group_k), ceil(N / group_n)] = {list(groups)} for groups "
            f"of {group_k} x {group_n}; got {scales.dtype} {list(scales.shape)}"
        )
