"""``hfaccel bench fp8``: fp8 weights (float8 e4m3, ``hfaccel.kernels.fp8``: weight-only up to mid M, fp8 tensor cores
(W8A8) at large M on a GPU) against the same product
in bf16 (issue 50's goals on a GPU: the kernel ≥ 1.8× / 1.6× / 1.2× / 1.3× cuBLAS bf16 at M = 1 / 16 / 256 / 4096;
Llama-3.1-8B-shaped batch-1 decode ≥ 1.7× bf16, ≥ 75% of the fp8 weight-read roofline).

- Kernel: the routed ``fp8_matmul`` (per-channel scales) against cuBLAS (``F.linear`` on the dense weight) at
  Llama-3.1-8B Linear shapes for M = 1, 16, 256, 4096, each timed in a CUDA graph over weight copies twice the L2's
  size (``timing.cold_graph_time_ms``, as ``bench int4``); the fp8 bytes read per µs against the read bandwidth.
- End to end: greedy ``generate`` decode steps of the random-weight model accelerated in bf16 (or the first
  ``--dtype``), then the same model quantized to fp8 (``quantize="fp8"``) and accelerated, at batch 1 and 16; with
  the weight bytes a step reads and the share of the read bandwidth that rate implies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.kernels import resolve_backend
from hfaccel.kernels.fp8 import FP8_DTYPE, fp8_matmul
from hfaccel.kernels.fp8_config import pick_fp8_config
from hfaccel.quant import quantize
from hfaccel.tools.bench.decode import QuantizedDecodeRow, dense_then_quantized
from hfaccel.tools.bench.timing import cold_graph_time_ms, l2_cold_copies, read_bandwidth, row_line, table, tensor_bytes

CUDA_SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]  # (K, N) = (in, out) features
CPU_SHAPES = [(256, 384)]
CUDA_MS = [1, 16, 256, 4096]
CPU_MS = [1, 16]


@dataclass
class Fp8KernelRow:
    k: int
    n: int
    m: int
    dtype: str
    path: str  # what the router picked (the torch reference where Triton does not run)
    fp8_us: float
    cublas_us: float
    speedup: float  # cublas_us / fp8_us
    fp8_gb_per_s: float  # fp8 weight bytes (weights + scales) / fp8_us
    read_bw_pct: float


def random_fp8_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [K, N] e4m3, scales [1, N] fp32)``: per-channel scales, the kernel layout."""
    weight = (torch.randn(k, n, device=device) * 100).clamp(-448, 448).to(FP8_DTYPE)
    return weight, torch.rand(1, n, device=device) * 0.001 + 1e-4


def bench_fp8_kernels(shapes, ms, dtypes, device: torch.device, on_row=lambda row: None) -> list[Fp8KernelRow]:
    bandwidth = read_bandwidth(device)
    rows = []
    for k, n in shapes:
        first = random_fp8_weight(n, k, device)
        weights = [first] + [
            random_fp8_weight(n, k, device) for _ in range(l2_cold_copies(tensor_bytes(first), device) - 1)
        ]
        for dtype in dtypes:
            denses = [
                torch.randn(n, k, device=device, dtype=dtype) * 0.02
                for _ in range(l2_cold_copies(n * k * dtype.itemsize, device))
            ]
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype)
                fp8 = cold_graph_time_ms([lambda w=w: fp8_matmul(x, w[0], w[1], k, 1) for w in weights], device) * 1e3
                cublas = cold_graph_time_ms([lambda d=d: F.linear(x, d) for d in denses], device) * 1e3
                path = (
                    pick_fp8_config(m, n, k, dtype, k, 1, device).label
                    if resolve_backend("auto", device) == "triton"
                    else "torch reference"
                )
                gb_per_s = tensor_bytes(first) / fp8 / 1e3
                rows.append(
                    Fp8KernelRow(
                        k,
                        n,
                        m,
                        str(dtype).removeprefix("torch."),
                        path,
                        fp8,
                        cublas,
                        cublas / fp8,
                        gb_per_s,
                        100 * gb_per_s / bandwidth,
                    )
                )
                on_row(rows[-1])
    return rows


def bench_fp8_decode(
    spec: str, batches, prompt_len: int, new_tokens: int, device: torch.device, dtype: torch.dtype
) -> list[QuantizedDecodeRow]:
    """Accelerated generate() tokens/s with 16-bit weights, then fp8 (per-channel scales)."""

    def fp8(model) -> str:
        quantize(model, "fp8")
        return "fp8 e4m3 per channel"

    return dense_then_quantized(spec, batches, prompt_len, new_tokens, device, dtype, fp8)


def run(options, console) -> dict:
    dtypes = [torch.bfloat16] if options.cuda and torch.bfloat16 in options.dtypes else options.dtypes[:1]
    kernels = [
        asdict(r)
        for r in bench_fp8_kernels(
            CUDA_SHAPES if options.cuda else CPU_SHAPES,
            CUDA_MS if options.cuda else CPU_MS,
            dtypes,
            options.device,
            lambda r: console.print(row_line(r)),
        )
    ]
    console.print(table("fp8 (e4m3, per-channel scales; the routed path) vs cuBLAS: x [M, K] @ W [K, N]", kernels))
    decode = [
        asdict(r)
        for r in bench_fp8_decode(
            options.model or ("llama-3.1-8b" if options.cuda else "tiny-llama"),
            options.batches or [1, 16],
            options.prompt_len or (128 if options.cuda else 16),
            options.new_tokens or (128 if options.cuda else 8),
            options.device,
            dtypes[0],
        )
    ]
    console.print(table("fp8 vs 16-bit weights: accelerated generate() tokens/s", decode))
    return {"fp8_kernels": kernels, "fp8_decode": decode}
