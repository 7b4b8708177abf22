"""``hfaccel tune --op paged_attention``: the decode kernel's split count and tiles per (head dim, query heads per
KV head, batch, context, dtype) bucket, timed replayed in a CUDA graph (as hfaccel's captured decode steps run
it). Splits first (the heuristic tiles), then the tiles at the best split count."""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from hfaccel.kernels.paged_attention import (
    MAX_SPLITS, OP, candidate_paged_configs, default_paged_config, paged_attention, plan_launch, table_key,
)
from hfaccel.tools.tune._measure import fastest

__all__ = ["OP", "sweep"]

DTYPES = (torch.float16, torch.bfloat16)
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 16384, 32768)
BLOCK_SIZE = 16  # the KV pool's block size (hfaccel's default)


def sweep(shapes, device: torch.device, console) -> dict[str, dict]:
    """Bucket key -> the fastest configuration's fields (``num_splits`` included) and its ``us``."""
    results = {}
    for heads, kv_heads, head_dim in sorted({(s.num_heads, s.num_kv_heads, s.head_dim) for s in shapes}):
        for dtype in DTYPES:
            for batch in BATCHES:
                for context in CONTEXTS:
                    key = table_key(head_dim, heads // kv_heads, batch, context, dtype)
                    results[key] = _bucket(batch, context, heads, kv_heads, head_dim, dtype, device, console)
                    console.print(f"  {key}: {results[key]}")
    return results


def split_candidates(heuristic: int, context: int) -> list[int]:
    """Split counts to measure: powers of two up to MAX_SPLITS and the heuristic's, each leaving >= 64 keys per
    split."""
    counts = {1, heuristic} | {2 ** i for i in range(1, MAX_SPLITS.bit_length())}
    return sorted(n for n in counts if n == 1 or context // n >= 64)


def _bucket(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device, console) -> dict:
    blocks = batch * -(-context // BLOCK_SIZE)
    pool = torch.randn(2, blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()  # shuffled, as a live pool is
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)

    def call(cfg):
        return paged_attention(q, pool[0], pool[1], tables, lens, max_seqlen_k=context, config=cfg)

    group = heads // kv_heads
    heuristic = plan_launch(batch, kv_heads, group, 1, context, head_dim, dtype, device,
                            default_paged_config(head_dim, dtype, group))
    splits = [replace(heuristic, num_splits=n) for n in split_candidates(heuristic.num_splits, context)]
    best_split, _ = fastest(splits, call, device, console, graph=True)
    tiles = [replace(cfg, num_splits=best_split.num_splits) for cfg in candidate_paged_configs(head_dim, dtype, group)]
    config, us = fastest(tiles, call, device, console, graph=True)
    fields = asdict(config)
    del fields["block_m"]  # follows the rows at run time
    return {**fields, "us": round(us, 2)}
