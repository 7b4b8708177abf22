"""``hfaccel bench paged``: decode attention over the paged KV pool — GB/s of K/V read against the bandwidth of a
read-only kernel, and time against torch SDPA reading the same K/V held contiguously, context 1k–32k, batch 1–64.
On CUDA each path is timed twice: as called eagerly (host work included) and replayed in a CUDA graph (the GPU
time alone, as in hfaccel's captured decode steps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.kernels.paged_attention import paged_attention, plan_launch, tuned_entry
from hfaccel.tools.bench.timing import copy_bandwidth, graph_time_ms, read_bandwidth, row_line, table, time_ms

# (batch, context) of the paged decode grid; heads 32 over 8 KV heads, head_dim 128 (Llama-3-8B shapes).
CUDA_GRID = [(b, c) for c in (1024, 4096, 16384, 32768) for b in (1, 8, 64)]
CPU_GRID = [(1, 128), (2, 256)]


@dataclass
class PagedRow:
    batch: int
    context: int
    dtype: str
    hfaccel_ms: float  # eager call
    hfaccel_graph_ms: float  # replayed in a CUDA graph (= hfaccel_ms off CUDA)
    sdpa_ms: float
    sdpa_graph_ms: float
    kv_gb_per_s: float  # K/V bytes / hfaccel_graph_ms
    read_gb_per_s: float  # a read-only kernel's bandwidth: the roofline
    copy_gb_per_s: float
    fraction_of_read: float
    speedup: float  # sdpa_graph_ms / hfaccel_graph_ms
    num_splits: int
    block_n: int
    config_from: str  # where the launch's configuration came from: the GPU's tuned table or the heuristics


def bench_paged(
    grid,
    dtype: torch.dtype,
    device: torch.device,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    on_row: Callable[[PagedRow], None] = lambda row: None,
) -> list[PagedRow]:
    """One decode step of attention over the paged pool (shuffled blocks) vs SDPA on contiguous K/V; ``on_row``
    sees each row as it is measured."""
    bandwidth = read_bandwidth(device), copy_bandwidth(device)
    shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    rows = []
    for batch, context in grid:
        rows.append(_row(batch, context, dtype, device, bandwidth, **shapes))
        on_row(rows[-1])
    return rows


def _row(
    batch: int,
    context: int,
    dtype: torch.dtype,
    device: torch.device,
    bandwidth: tuple[float, float],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> PagedRow:
    blocks = batch * -(-context // block_size)
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()  # shuffled, as a live pool is
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    ours = lambda: paged_attention(q, pool[0], pool[1], tables, lens, max_seqlen_k=context)  # noqa: E731
    k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    theirs = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    ours_graph, theirs_graph = graph_time_ms(ours, device), graph_time_ms(theirs, device)
    gb_per_s = 2 * batch * context * kv_heads * head_dim * q.element_size() / ours_graph / 1e6
    plan = plan_launch(batch, kv_heads, heads // kv_heads, 1, context, head_dim, dtype, device)
    tuned = tuned_entry(batch, heads // kv_heads, 1, context, head_dim, dtype, device) is not None
    return PagedRow(
        batch,
        context,
        str(dtype).removeprefix("torch."),
        time_ms(ours, device),
        ours_graph,
        time_ms(theirs, device),
        theirs_graph,
        gb_per_s,
        *bandwidth,
        gb_per_s / bandwidth[0],
        theirs_graph / ours_graph,
        plan.num_splits,
        plan.block_n,
        "tuned table" if tuned else "heuristics",
    )


def run(options, console) -> dict:
    shapes = {} if options.cuda else dict(heads=8, kv_heads=2, head_dim=64)
    rows = [
        asdict(r)
        for r in bench_paged(
            CUDA_GRID if options.cuda else CPU_GRID,
            options.dtypes[0],
            options.device,
            **shapes,
            on_row=lambda r: console.print(row_line(r)),
        )
    ]
    console.print(
        table("paged decode attention: hfaccel (paged pool) vs SDPA (contiguous K/V), eager and in a CUDA graph", rows)
    )
    return {"paged": rows}
