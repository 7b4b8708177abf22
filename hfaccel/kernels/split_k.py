"""Split-K for the weight-streaming matmuls (``w4a16``, ``fp8``): K shared by several programs when the output
tiles alone leave SMs idle (decode's M = 1 over a narrow N).

Each split writes an fp32 partial sum ``[S, M, N]`` and :func:`finish` adds them in split order, so results never
depend on scheduling (no atomics): the same call gives bit-identical outputs run to run. A split is whole K tiles,
so a tile that lies in one scale group still does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUM_BLOCK = 1024


@triton.jit
def _sum_splits_kernel(PARTIAL, OUT, numel, splits, BLOCK: tl.constexpr):
    # OUT = sum of PARTIAL[split] (flattened [splits, numel] fp32) in split order, in OUT's dtype.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ptrs = PARTIAL + offs
    for _ in range(splits):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += numel  # pointer arithmetic: no int32 overflow past 2**31 elements
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def split_count(target_programs: int, programs: int, max_split: int) -> int:
    """The largest power of two that brings ``programs`` up to about ``target_programs``, at most ``max_split``."""
    split = 1
    while split * 2 * programs <= target_programs and split * 2 <= max_split:
        split *= 2
    return split


def partials_cap(m: int, k: int, weight_bits: int) -> int:
    """The most splits whose fp32 partials (written, then read by the sum: 8 bytes per output per split) move no
    more bytes than the weight each output reads (``k * weight_bits / 8``): splitting pays at decode's few rows, not
    at a prefill's many."""
    return max(1, k * weight_bits // (64 * m))


def fit_split(split_k: int, k: int, block_k: int) -> int:
    """``split_k`` capped at K's number of ``block_k`` tiles (at least 1): no split without a tile of its own."""
    return max(1, min(split_k, triton.cdiv(k, block_k)))


def k_slices(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """``(k_per_split, splits)``: K cut into ``split_k`` slices of whole ``block_k`` tiles (fewer where K has too
    few tiles for that many; one, empty, where K is 0)."""
    if k == 0:
        return block_k, 1
    per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return per_split, triton.cdiv(k, per_split)


def partial_out(splits: int, m: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """What a kernel writes: ``[splits, M, N]``, fp32 partials when split, else the output in ``like``'s dtype."""
    dtype = torch.float32 if splits > 1 else like.dtype
    return torch.empty(splits, m, n, device=like.device, dtype=dtype)


def finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` from :func:`partial_out` as ``[M, N]`` of ``dtype``: the one slice, or the partials summed in order."""
    if out.shape[0] == 1:
        return out[0]
    total = torch.empty(out.shape[1:], device=out.device, dtype=dtype)
    numel = total.numel()
    _sum_splits_kernel[(triton.cdiv(numel, SUM_BLOCK),)](out, total, numel, out.shape[0], BLOCK=SUM_BLOCK)
    return total
