"""``hfaccel bench paged``: decode attention over the paged KV pool — GB/s of K/V read against the measured
copy bandwidth, and time against torch SDPA reading the same K/V held contiguously, context 1k–32k, batch
1–64."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.kernels.paged_attention import paged_attention
from hfaccel.tools.bench.timing import copy_bandwidth, table, time_ms

# (batch, context) of the paged decode grid; heads 32 over 8 KV heads, head_dim 128 (Llama-3-8B shapes).
CUDA_GRID = [(b, c) for c in (1024, 4096, 16384, 32768) for b in (1, 8, 64)]
CPU_GRID = [(1, 128), (2, 256)]


@dataclass
class PagedRow:
    batch: int
    context: int
    dtype: str
    hfaccel_ms: float
    sdpa_ms: float
    kv_gb_per_s: float
    copy_gb_per_s: float
    fraction_of_copy: float  # K/V read bandwidth / measured copy bandwidth
    speedup: float  # sdpa (contiguous K/V) time / hfaccel paged time


def bench_paged(grid, dtype: torch.dtype, device: torch.device, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128, block_size: int = 16) -> list[PagedRow]:
    """One decode step of attention over the paged pool (shuffled blocks) vs SDPA on contiguous K/V."""
    copy = copy_bandwidth(device)
    shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    return [_row(batch, context, dtype, device, copy, **shapes) for batch, context in grid]


def _row(batch: int, context: int, dtype: torch.dtype, device: torch.device, copy: float, *, heads: int,
         kv_heads: int, head_dim: int, block_size: int) -> PagedRow:
    blocks = batch * -(-context // block_size)
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()  # shuffled, as a live pool is
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    ours = time_ms(lambda: paged_attention(q, pool[0], pool[1], tables, lens, max_seqlen_k=context), device)
    k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    theirs = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device)
    gb_per_s = 2 * batch * context * kv_heads * head_dim * q.element_size() / ours / 1e6
    return PagedRow(batch, context, str(dtype).removeprefix("torch."), ours, theirs, gb_per_s, copy,
                    gb_per_s / copy, theirs / ours)


def run(options, console) -> dict:
    shapes = {} if options.cuda else dict(heads=8, kv_heads=2, head_dim=64)
    rows = [asdict(r) for r in bench_paged(CUDA_GRID if options.cuda else CPU_GRID, options.dtypes[0],
                                             options.device, **shapes)]
    console.print(table("paged decode attention: hfaccel (paged pool) vs SDPA (contiguous K/V)", rows))
    return {"paged": rows}
