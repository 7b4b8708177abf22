"""``hfaccel tune --op fp8``: the fastest fp8 configuration per bucket (M, N, K, scale layout, dtype).

For each Linear shape of the named models, each scale layout (per output channel, as compressed-tensors
``FP8-dynamic`` and FBGEMM checkpoints; 128×128 blocks, as block-FP8 ones), each M bucket and each dtype, every
candidate of ``hfaccel.kernels.fp8_config.candidate_configs`` — GEMV tilings, 16-bit tensor-core tiles, fp8
tensor-core (W8A8) tiles, the dequantized weight's dense matmul — runs on random weights and the fastest wins, timed
as ``hfaccel tune --op w4a16`` times (CUDA-graph replays over weight copies twice the L2's size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from hfaccel.kernels.fp8 import FP8_DTYPE, fp8_matmul
from hfaccel.kernels.fp8_config import M_BUCKETS, OP, candidate_configs, table_key
from hfaccel.tools.bench.timing import l2_cold_copies
from hfaccel.tools.tune._measure import fastest_cold
from hfaccel.tools.tune.w4a16 import linear_shapes

DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 128  # the block layout's weight blocks (block FP8 checkpoints: 128 x 128)
TIMED_MS = 5

__all__ = ["OP", "sweep"]


def layouts(n: int, k: int, blocks: bool = True) -> list[tuple[int, int]]:
    """``(group_k, group_n)`` of the scale layouts measured for an ``[K, N]`` weight: per channel, and 128×128
    blocks where K holds whole blocks."""
    return [(k, 1)] + ([(BLOCK, BLOCK)] if blocks and k % BLOCK == 0 else [])


def random_weights(
    n: int, k: int, group_k: int, group_n: int, device: torch.device, copies: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` random fp8 weights ``[K, N]`` and their scales in the layout."""
    weights = []
    for _ in range(copies):
        weight = (torch.randn(k, n, device=device) * 100).clamp(-448, 448).to(FP8_DTYPE)
        scales = torch.rand(-(-k // group_k), -(-n // group_n), device=device) * 1e-3 + 1e-4
        weights.append((weight, scales))
    return weights


def sweep(
    shapes,
    device: torch.device,
    console,
    *,
    m_buckets: Sequence[int] = M_BUCKETS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    blocks: bool = True,
    reps: int = 5,
) -> Iterator[tuple[str, dict]]:
    """``(bucket key, {config fields..., "us": median microseconds})`` for the models' shapes, as each is measured.
    ``reps`` counts timed runs off CUDA (tests); on CUDA do_bench decides."""
    for n, k in linear_shapes(shapes):
        for group_k, group_n in layouts(n, k, blocks):
            copies = l2_cold_copies(n * k + 4 * -(-k // group_k) * -(-n // group_n), device)
            weights = random_weights(n, k, group_k, group_n, device, copies)
            for dtype in dtypes:
                x = torch.randn(max(m_buckets), k, device=device, dtype=dtype)
                for m in m_buckets:
                    rows = x[:m]
                    best, us = fastest_cold(
                        candidate_configs(m, k, dtype, group_k),
                        lambda cfg: [lambda w=w: fp8_matmul(rows, *w, group_k, group_n, config=cfg) for w in weights],
                        device,
                        console,
                        reps,
                        TIMED_MS,
                    )
                    console.print(
                        f"  fp8 M={m} N={n} K={k} {str(dtype).removeprefix('torch.')} "
                        f"groups {group_k}x{group_n}: {best.label}, {us:.1f} us"
                    )
                    yield table_key(m, n, k, dtype, group_k, group_n), {**best.entry(), "us": round(us, 2)}
