"""``hfaccel bench int4``: int4 weights (W4A16) against the same product in fp16/bf16.

- Kernel: the routed ``w4a16_matmul`` against cuBLAS (``F.linear`` on the dense weight) and against the
  dequantize + cuBLAS path, at Llama-3.1-8B Linear shapes (K x N = 4096 x 4096, 4096 x 14336, 14336 x 4096,
  4096 x 128256) for M = 1, 4, 16, 64, 256, 1024: microseconds, ratios, GB/s of int4 weights (packed words,
  scales, zeros) read and their share of the measured read bandwidth. On CUDA each is timed in a CUDA graph that
  calls it in turn over copies of its weights twice the L2's size (``timing.cold_graph_time_ms``): the GPU's time
  with the weights read from HBM, as a captured decode step pays it, without an eager call's host work (the eager
  timings of an H200 run, 2026-11-26, sat at ~45 us for 8 MB and 29 MB of int4 weights alike). On a CPU without
  Triton the int4 column is what ``Int4Linear`` serves there: torch's int4 CPU kernel on the weight repacked once
  (``int4pack``, bf16); the dequant column is the torch reference (dequantize every call, fp32 matmul), the path
  it replaced, and the cuBLAS column the dense ``F.linear``.
- End to end: greedy ``generate`` decode steps of a random-weight model (Llama-3.1-8B config on CUDA) accelerated
  in fp16 (or the first ``--dtype``), then the same model RTN-quantized to int4 (g=128, or the largest of 64 and 32
  that quantizes every layer) and accelerated, at batch
  1 and 16 (``bench decode``'s step timing); with the weight bytes one step reads and the share of the read
  bandwidth that rate implies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.kernels import resolve_backend
from hfaccel.kernels.w4a16 import int4pack_device, int4pack_matmul, int4pack_unsupported, pack_int4_cpu, w4a16_matmul
from hfaccel.kernels.w4a16_config import W4A16Config, pick_w4a16_config
from hfaccel.quant import quantize
from hfaccel.tools.bench.decode import QuantizedDecodeRow, dense_then_quantized
from hfaccel.tools.bench.timing import cold_graph_time_ms, l2_cold_copies, read_bandwidth, row_line, table, tensor_bytes

CUDA_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256)]  # (K, N) = (in, out) features
CPU_SHAPES = [(256, 384)]
CUDA_MS = [1, 4, 16, 64, 256, 1024]
CPU_MS = [1, 16]
GROUP_SIZE = 128


@dataclass
class Int4KernelRow:
    k: int
    n: int
    m: int
    dtype: str
    path: str  # what the router picked (or the torch reference off CUDA)
    int4_us: float
    cublas_us: float
    dequant_cublas_us: float
    speedup: float  # cublas_us / int4_us
    int4_gb_per_s: float  # int4 weight bytes (packed words + scales + zeros) / int4_us
    read_bw_pct: float  # int4_gb_per_s against the measured read bandwidth


def random_int4_weight(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device):
    """``(qweight [K/8, N], scales, zeros [K/g, N])`` with random values, in the kernel layout."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device)
    scales = (torch.rand(k // group_size, n, device=device) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), device=device).to(dtype)
    return qweight, scales, zeros


def random_int4_weights(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """Copies of :func:`random_int4_weight`, as many as keep each call of a timed replay that takes them in turn
    reading its weights from HBM (:func:`timing.l2_cold_copies`; one off CUDA)."""
    weights = [random_int4_weight(n, k, group_size, dtype, device)]
    return weights + [
        random_int4_weight(n, k, group_size, dtype, device)
        for _ in range(l2_cold_copies(tensor_bytes(weights[0]), device) - 1)
    ]


def bench_int4_kernels(
    shapes, ms, dtypes, device: torch.device, on_row: Callable[[Int4KernelRow], None] = lambda row: None
) -> list[Int4KernelRow]:
    """Each ``(k, n)`` of ``shapes`` at each dtype and M; ``on_row`` sees each row as it is measured."""
    bandwidth = read_bandwidth(device)
    rows = []
    for k, n in shapes:
        for dtype in dtypes:
            weights = random_int4_weights(n, k, GROUP_SIZE, dtype, device)  # made once for every M
            denses = [
                torch.randn(n, k, device=device, dtype=dtype) * 0.02  # nn.Linear.weight layout
                for _ in range(l2_cold_copies(n * k * dtype.itemsize, device))
            ]
            for m in ms:
                rows.append(
                    _kernel_row(torch.randn(m, k, device=device, dtype=dtype), weights, denses, device, bandwidth)
                )
                on_row(rows[-1])
    return rows


def _kernel_row(
    x: torch.Tensor, weights: list[tuple], denses: list[torch.Tensor], device: torch.device, bandwidth: float
) -> Int4KernelRow:
    """``x [M, K]`` times the int4 weight copies ``weights`` (routed, and dequantize + cuBLAS) and the dense
    ``denses [N, K]`` (cuBLAS), each timed over its copies in turn."""
    (m, k), n, dtype = x.shape, denses[0].shape[0], x.dtype
    weight_bytes = tensor_bytes(weights[0])  # packed words, scales, zeros
    int4_calls, paths = zip(*(_int4_path(x, weight, device) for weight in weights))
    path = paths[0]
    int4 = cold_graph_time_ms(int4_calls, device) * 1e3
    cublas = cold_graph_time_ms([lambda dense=dense: F.linear(x, dense) for dense in denses], device) * 1e3
    dequant = (
        cold_graph_time_ms(
            [
                lambda weight=weight: w4a16_matmul(x, *weight, GROUP_SIZE, config=W4A16Config("dequant"))
                for weight in weights
            ],
            device,
        )
        * 1e3
    )
    gb_per_s = weight_bytes / int4 / 1e3
    return Int4KernelRow(
        k,
        n,
        m,
        str(dtype).removeprefix("torch."),
        path,
        int4,
        cublas,
        dequant,
        cublas / int4,
        gb_per_s,
        100 * gb_per_s / bandwidth,
    )


def _int4_path(x: torch.Tensor, weight, device: torch.device) -> tuple[Callable[[], torch.Tensor], str]:
    """(the int4 product of ``x`` that hfaccel serves on ``device``, its label): torch's CPU kernel on the repacked
    weight on a CPU without Triton (where the kernel takes the group size), else the routed ``w4a16_matmul``."""
    m, k = x.shape
    if int4pack_device(device) and int4pack_unsupported(GROUP_SIZE) is None:
        pack = pack_int4_cpu(*weight, GROUP_SIZE)
        return (lambda: int4pack_matmul(x, pack)), "int4pack (torch CPU kernel, bf16)"
    if resolve_backend("auto", device) == "triton":
        label = pick_w4a16_config(m, weight[0].shape[1], k, x.dtype, GROUP_SIZE, device).label
    else:
        label = "torch reference"
    return (lambda: w4a16_matmul(x, *weight, GROUP_SIZE)), label


def whole_group_size(model: torch.nn.Module) -> int:
    """The largest of 128, 64 and 32 that divides the input width of every Linear but the head, so that every
    layer is quantized (SmolLM2's 576 takes 64; at 128 only its down projections would be)."""
    widths = {
        m.in_features
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    }
    return next((g for g in (GROUP_SIZE, 64, 32) if all(w % g == 0 for w in widths)), GROUP_SIZE)


def bench_int4_decode(
    spec: str, batches, prompt_len: int, new_tokens: int, device: torch.device, dtype: torch.dtype
) -> list[QuantizedDecodeRow]:
    """Accelerated generate() tokens/s with dense weights, then RTN int4 (:func:`whole_group_size`)."""

    def int4(model) -> str:
        group_size = whole_group_size(model)
        quantize(model, "rtn", group_size=group_size)
        return f"int4 rtn g{group_size}"

    return dense_then_quantized(spec, batches, prompt_len, new_tokens, device, dtype, int4)


def run(options, console) -> dict:
    kernels = [
        asdict(r)
        for r in bench_int4_kernels(
            CUDA_SHAPES if options.cuda else CPU_SHAPES,
            CUDA_MS if options.cuda else CPU_MS,
            options.dtypes,
            options.device,
            lambda r: console.print(row_line(r)),
        )
    ]
    console.print(table(f"int4 W4A16 (g={GROUP_SIZE}) vs cuBLAS: x [M, K] @ W [K, N]", kernels))
    decode = [
        asdict(r)
        for r in bench_int4_decode(
            options.model or ("llama-3.1-8b" if options.cuda else "tiny-llama"),
            options.batches or [1, 16],
            options.prompt_len or (128 if options.cuda else 16),
            options.new_tokens or (128 if options.cuda else 8),
            options.device,
            options.dtypes[0],
        )
    ]
    console.print(table("int4 vs dense weights: accelerated generate() tokens/s", decode))
    return {"int4_kernels": kernels, "int4_decode": decode}
