"""``hfaccel tune --op w4a16``: the fastest W4A16 configuration per bucket (M, N, K, dtype, group size).

For each Linear shape of the named models (q, k/v, o, gate/up, down projections and the LM head), each M bucket
and each dtype, every candidate of ``hfaccel.kernels.w4a16_config.candidate_configs`` — GEMV tilings and splits,
split-K and full tensor-core GEMMs, dequantize + cuBLAS — runs on random weights and the fastest wins. Times are
medians of CUDA-graph replays that call the candidate in turn over copies of the weights twice the L2's size
(``timing.cold_graph_time_ms``): a captured decode step pays the GPU's time with its weights read from HBM, not
the host work of an eager call nor the L2 hits of a repeated one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from hfaccel.kernels.w4a16 import w4a16_matmul
from hfaccel.kernels.w4a16_config import M_BUCKETS, OP, candidate_configs, table_key
from hfaccel.tools.bench.int4 import random_int4_weights
from hfaccel.tools.tune._measure import fastest_cold

DTYPES = (torch.float16, torch.bfloat16)
GROUP_SIZES = (128,)
TIMED_MS = 5  # GPU milliseconds of each timed replay: a few calls captured per candidate, ten replays timed

__all__ = ["OP", "linear_shapes", "sweep"]


def linear_shapes(shapes) -> list[tuple[int, int]]:
    """``(N, K)`` = (out, in) features of every distinct Linear of the models (``ModelShapes``), LM head included."""
    found = []
    for s in shapes:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        found += [
            (q, s.hidden_size),
            (kv, s.hidden_size),
            (s.hidden_size, q),
            (s.intermediate_size, s.hidden_size),
            (s.hidden_size, s.intermediate_size),
            (s.vocab_size, s.hidden_size),
        ]
    return list(dict.fromkeys(found))


def sweep(
    shapes,
    device: torch.device,
    console,
    *,
    m_buckets: Sequence[int] = M_BUCKETS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    group_sizes: Sequence[int] = GROUP_SIZES,
    reps: int = 5,
) -> Iterator[tuple[str, dict]]:
    """``(bucket key, {config fields..., "us": median microseconds})`` for the models' shapes, as each is measured.
    ``reps`` counts timed runs off CUDA (tests); on CUDA do_bench decides."""
    for n, k in linear_shapes(shapes):
        for dtype in dtypes:
            for group_size in group_sizes:
                if k % group_size:
                    continue
                weights = random_int4_weights(n, k, group_size, dtype, device)
                x = torch.randn(max(m_buckets), k, device=device, dtype=dtype)
                for m in m_buckets:
                    rows = x[:m]
                    best, us = fastest_cold(
                        candidate_configs(m, n, k, dtype, group_size),
                        lambda cfg: [lambda w=w: w4a16_matmul(rows, *w, group_size, config=cfg) for w in weights],
                        device,
                        console,
                        reps,
                        TIMED_MS,
                    )
                    console.print(
                        f"  w4a16 M={m} N={n} K={k} {str(dtype).removeprefix('torch.')} g={group_size}: "
                        f"{best.label}, {us:.1f} us"
                    )
                    yield table_key(m, n, k, dtype, group_size), {**best.entry(), "us": round(us, 2)}
