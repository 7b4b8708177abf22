"""``hfaccel bench attention``: hfaccel's flash attention vs torch SDPA (its flash backend on CUDA) — causal
prefill, TFLOP/s."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.kernels import flash_attention, resolve_backend
from hfaccel.kernels.flash_attention import attention_flops
from hfaccel.tools.bench.timing import table, time_ms

# (batch, heads, seq, head_dim) of the prefill attention grid.
CUDA_GRID = [(4, 32, 1024, 128), (2, 32, 2048, 128), (1, 32, 4096, 128), (1, 32, 8192, 128),
             (4, 32, 2048, 64), (1, 16, 2048, 256), (1, 32, 2048, 80)]
CPU_GRID = [(1, 4, 128, 64), (1, 4, 256, 128)]


@dataclass
class AttentionRow:
    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    hfaccel_ms: float
    sdpa_ms: float
    hfaccel_tflops: float
    sdpa_tflops: float
    speedup: float  # sdpa time / hfaccel time
    hfaccel_path: str


def bench_attention(grid, dtypes, device: torch.device) -> list[AttentionRow]:
    """Causal prefill attention, hfaccel vs torch SDPA, on random inputs of each grid shape and dtype."""
    return [_row(*shape, dtype, device) for shape in grid for dtype in dtypes]


def _row(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionRow:
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3))
    ours = time_ms(lambda: flash_attention(q, k, v, causal=True), device)
    theirs = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal=True)
    return AttentionRow(batch, heads, seq, head_dim, str(dtype).removeprefix("torch."), ours, theirs,
                        flops / ours / 1e9, flops / theirs / 1e9, theirs / ours, resolve_backend("auto", device))


def run(options, console) -> dict:
    rows = [asdict(r) for r in bench_attention(CUDA_GRID if options.cuda else CPU_GRID, options.dtypes,
                                                 options.device)]
    console.print(table("prefill attention (causal): hfaccel vs torch SDPA", rows))
    return {"attention": rows}
