"""``hfaccel tune --op paged_attention``: the decode kernel's split count and tiles per (head dim, query heads per
KV head, batch, context, dtype) bucket, timed replayed in a CUDA graph (as hfaccel's captured decode steps run
it). Splits first (the heuristic tiles), then the tiles at the best split count.

The batches are every size a captured decode step launches at (``hfaccel.runner.graphs.DEFAULT_LADDER``), the
contexts 1k, 4k, 16k and 32k; a launch between or beyond them (a captured step is sized for ``max_model_len``)
reads the nearest measured bucket (``hfaccel.kernels.tuning.nearest_key``). That is 13 x 4 = 52 buckets per
(attention shape, dtype), 104 per model (two dtypes). Each times its 4-5 tile candidates and, where the grid
leaves SMs idle, split counts (only those that keep the grid within ``SPLIT_WAVES`` waves of the SMs: with 8 KV
heads on an H100, 2-7 counts up to batch 32, none from batch 48 on): ~700 timings per model, 0.2-1 s each in a
CUDA graph, so 3-12 minutes per model (estimated, not measured: the first GPU run says). The largest bucket's
pool (batch 256 x 32k keys x 8 KV heads x head dim 128, K and V, 16-bit) holds 34 GB.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace

import torch

from hfaccel.kernels.paged_attention import (
    MAX_SPLITS,
    OP,
    candidate_paged_configs,
    default_paged_config,
    paged_attention,
    plan_launch,
    table_key,
)
from hfaccel.kernels.runtime import num_sms
from hfaccel.runner.graphs import DEFAULT_LADDER
from hfaccel.tools.tune._measure import fastest

__all__ = ["OP", "sweep"]

DTYPES = (torch.float16, torch.bfloat16)
BATCHES = DEFAULT_LADDER  # every batch size a captured decode step launches at
CONTEXTS = (1024, 4096, 16384, 32768)
BLOCK_SIZE = 16  # the KV pool's block size (hfaccel's default)
SPLIT_WAVES = 4  # split counts measured: those whose (sequence, KV head) programs x splits fill the SMs <= 4 times


def sweep(
    shapes, device: torch.device, console, *, dtypes: Sequence[torch.dtype] = DTYPES
) -> Iterator[tuple[str, dict]]:
    """``(bucket key, entry)`` as each is measured: the fastest configuration's fields (``num_splits`` included) and
    its ``us``."""
    for heads, kv_heads, head_dim, joined in sorted({s.decode_attention for s in shapes}):
        for dtype in dtypes:
            for batch in BATCHES:
                for context in CONTEXTS:
                    key = table_key(head_dim, heads // kv_heads, batch, context, dtype)
                    entry = _bucket(batch, context, heads, kv_heads, head_dim, dtype, device, console, joined)
                    console.print(f"  {key}: {entry}")
                    yield key, entry


def split_candidates(heuristic: int, context: int, most: int = MAX_SPLITS) -> list[int]:
    """Split counts to measure: powers of two up to ``most`` (at most MAX_SPLITS) and the heuristic's, each leaving
    >= 64 keys per split."""
    counts = {1, heuristic} | {2**i for i in range(1, min(most, MAX_SPLITS).bit_length())}
    return sorted(n for n in counts if n == 1 or context // n >= 64)


def _bucket(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    console,
    joined: bool = False,
) -> dict:
    blocks = batch * -(-context // BLOCK_SIZE)
    pool = torch.randn(2, blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    keys, values = pool[0], pool[1 if not joined else 0]  # a latent layer's row is read as its keys and its values
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()  # shuffled, as a live pool is
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)

    def call(cfg):
        return paged_attention(q, keys, values, tables, lens, max_seqlen_k=context, config=cfg)

    group = heads // kv_heads
    heuristic = plan_launch(
        batch, kv_heads, group, 1, context, head_dim, dtype, device, default_paged_config(head_dim, dtype, group)
    )
    most = SPLIT_WAVES * num_sms(device) // (batch * kv_heads)  # decode: one query tile per (sequence, KV head)
    splits = [replace(heuristic, num_splits=n) for n in split_candidates(heuristic.num_splits, context, most)]
    best_split = splits[0] if len(splits) == 1 else fastest(splits, call, device, console, graph=True)[0]
    tiles = [replace(cfg, num_splits=best_split.num_splits) for cfg in candidate_paged_configs(head_dim, dtype, group)]
    config, us = fastest(tiles, call, device, console, graph=True)
    fields = asdict(config)
    del fields["block_m"]  # follows the rows at run time
    return {**fields, "us": round(us, 2)}
