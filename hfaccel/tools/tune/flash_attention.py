"""``hfaccel tune --op flash_attention``: the prefill kernel's fastest tiles per (head dim, query heads per KV head,
query length, dtype) bucket, and torch SDPA's time on the same call (``sdpa_us``), which the attention router
compares with the kernel's (``us``) to send plain causal prefills to the faster of the two."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict

import torch

from hfaccel.attention.sdpa import sdpa_causal
from hfaccel.kernels.flash_attention import OP, SEQ_BUCKETS, candidate_configs, flash_attention, table_key
from hfaccel.tools.bench.timing import time_ms
from hfaccel.tools.tune._measure import fastest

__all__ = ["OP", "sweep"]

DTYPES = (torch.float16, torch.bfloat16)
TOKENS = 16384  # batch x query length of each measurement (batch 1 from 16k on)


def sweep(
    shapes, device: torch.device, console, *, dtypes: Sequence[torch.dtype] = DTYPES
) -> Iterator[tuple[str, dict]]:
    """``(bucket key, entry)`` as each is measured: the fastest candidate's fields, its ``us`` and SDPA's
    ``sdpa_us`` for every attention shape of ``shapes`` (model dims), 16-bit dtype and tuned query length."""
    for heads, kv_heads, head_dim in sorted({(s.num_heads, s.num_kv_heads, s.head_dim) for s in shapes}):
        for dtype in dtypes:
            for seq in SEQ_BUCKETS:
                key = table_key(head_dim, heads // kv_heads, seq, dtype)
                entry = _bucket(max(1, TOKENS // seq), heads, kv_heads, seq, head_dim, dtype, device, console)
                console.print(f"  {key}: {entry}")
                yield key, entry


def _bucket(
    batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype, device: torch.device, console
) -> dict:
    def states(h):  # [B, H, S, D] views of [B, S, H, D] projections, as transformers passes them
        return torch.randn(batch, seq, h, head_dim, device=device, dtype=dtype).transpose(1, 2)

    q, k, v = states(heads), states(kv_heads), states(kv_heads)
    config, us = fastest(
        candidate_configs(head_dim, dtype),
        lambda cfg: flash_attention(q, k, v, causal=True, config=cfg),
        device,
        console,
    )
    sdpa_us = 1e3 * time_ms(lambda: sdpa_causal(q, k, v, None), device)
    return {**asdict(config), "us": round(us, 2), "sdpa_us": round(sdpa_us, 2)}
