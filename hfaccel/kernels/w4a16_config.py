"""Which kernel and tiles serve a W4A16 product ``x [M, K] @ W [K, N]``: the router of ``w4a16_matmul``.

Three paths (``hfaccel.kernels.w4a16``):

- ``gemv``: one row of ``x`` per program, no tensor cores, every program streaming ``[BLOCK_K / 8, BLOCK_N]``
  packed words with 128-bit loads; K split across programs when N alone gives too few (decode, M = 1);
- ``gemm``: a tensor-core tile GEMM, K split across programs for small M (split-K) and whole for large M;
- ``dequant``: dequantize the weight once to the activation dtype, then cuBLAS (large M, compute-bound).

A call asks :func:`pick_w4a16_config`: the tuned table of the present GPU (``hfaccel tune``, see
``hfaccel.kernels.tuning``) has the measured best configuration for the call's bucket — M rounded up to a
power of two, N, K, dtype and group size; an M not measured takes a measured M's next to it — and without an
entry the heuristics (sized for an H100) decide. The choice is a pure function of the bucket and the table:
the same call always takes the same path and tiles, so results are reproducible run to run.
:func:`candidate_configs` is the search space ``hfaccel tune`` measures.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import torch

from hfaccel.kernels import tuning
from hfaccel.kernels.runtime import DEFAULT_NUM_SMS, num_sms
from hfaccel.kernels.split_k import fit_split, partials_cap, split_count

OP = "w4a16"
PATHS = ("gemv", "gemm", "dequant")
M_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096: M is rounded up to one of these (and capped)
DEQUANT_MIN_M = 1024  # heuristic: from this M on, dequantize + cuBLAS beats the fused GEMM on an H100
GEMV_THREADS_COLUMNS = 128  # a GEMV warp covers 128 columns: 32 threads x 4 words (one 128-bit load each)


@dataclass(frozen=True)
class W4A16Config(tuning.TableConfig):
    """A path and its launch parameters. ``block_k`` never exceeds the largest power of two dividing the group
    size (a K-tile lies in one group: its scales and zeros are one row); ``split_k`` is how many programs share
    K (their fp32 partial sums are added in a fixed order, so results are deterministic)."""

    path: str
    block_m: int = 16  # gemm only (gemv programs take one row)
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    OP, PATHS = OP, PATHS

    def __post_init__(self):
        self.check_tiles(("block_m", "block_n", "block_k", "num_warps"))
        self.check_split_k()
        if self.block_k < 8 or (self.path == "gemm" and (self.block_k < 16 or self.block_m < 16)):
            raise ValueError(
                f"block_k must be >= 8 (>= 16 with block_m >= 16 for gemm, the smallest tensor-core tile); got {self}"
            )

    @property
    def label(self) -> str:
        """Short form for tables and logs: ``gemv 1x256x128 split 8, 2 warps, 1 stage``."""
        if self.path == "dequant":
            return "dequant + cuBLAS"
        return (
            f"{self.path} {self.block_m if self.path == 'gemm' else 1}x{self.block_n}x{self.block_k} "
            f"split {self.split_k}, {self.num_warps} warps, {self.num_stages} stages"
        )


def bucket_m(m: int) -> int:
    """M rounded up to a power of two, capped at the largest bucket."""
    return next((b for b in M_BUCKETS if b >= m), M_BUCKETS[-1])


def bucket_fields(m: int, n: int, k: int, dtype: torch.dtype, group_size: int) -> dict:
    """The tuned table's bucket of a call: M bucket, N, K, group size, dtype (in key order)."""
    return dict(m=bucket_m(m), n=n, k=k, g=group_size, dtype=dtype)


def table_key(m: int, n: int, k: int, dtype: torch.dtype, group_size: int) -> str:
    """The table key of a call: ``m16_n4096_k4096_g128_dtypefloat16``."""
    return tuning.bucket_key(**bucket_fields(m, n, k, dtype, group_size))


def group_block_k(group_size: int) -> int:
    """The largest K-tile that lies in one group: the largest power of two dividing ``group_size``."""
    return group_size & -group_size


def fit_config(config: W4A16Config, m: int, n: int, k: int, group_size: int) -> W4A16Config:
    """``config`` adapted to a shape: ``block_k`` within one group, ``split_k`` at most one K-tile per split.
    Raises ``ValueError`` when the path cannot serve the shape (a gemm needs K-tiles of >= 16 rows)."""
    block_k = min(config.block_k, group_block_k(group_size))
    if config.path == "gemm" and block_k < 16:
        raise ValueError(
            f"a gemm needs K-tiles of >= 16 rows inside one group; group_size={group_size} allows {block_k}"
        )
    block_k = max(block_k, 8)
    return replace(config, block_k=block_k, split_k=fit_split(config.split_k, k, block_k))


def pick_w4a16_config(
    m: int, n: int, k: int, dtype: torch.dtype, group_size: int, device: torch.device | str | None = None
) -> W4A16Config:
    """The configuration of a call: the tuned table's entry for its bucket on ``device``'s GPU, else for a
    measured M next to it (same N, K, group size and dtype; ``tuning.NEAREST_M_RATIO``), else the heuristics (a
    table entry that is malformed or cannot serve the shape warns and is not used)."""
    key = tuning.nearest_key(
        OP, device, ("m",), max_ratio=tuning.NEAREST_M_RATIO, **bucket_fields(m, n, k, dtype, group_size)
    )
    entry = None if key is None else tuning.lookup(OP, key, device)
    if entry is not None:
        try:
            return _tuned_config(tuple(sorted(entry.items())), m, n, k, group_size)
        except (TypeError, ValueError) as error:
            _warn_bad_entry(key, str(error))
    return heuristic_config(m, n, k, dtype, group_size, num_sms(device))


@functools.lru_cache(maxsize=4096)
def _tuned_config(entry: tuple, m: int, n: int, k: int, group_size: int) -> W4A16Config:
    return fit_config(W4A16Config.from_entry(dict(entry)), m, n, k, group_size)


@functools.cache
def _warn_bad_entry(key: str, error: str) -> None:
    warnings.warn(
        f"hfaccel: the tuned w4a16 entry {key} is unusable ({error}); using the heuristics. "
        f"`hfaccel tune --op w4a16` rewrites it.",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=4096)
def heuristic_config(
    m: int, n: int, k: int, dtype: torch.dtype, group_size: int, sms: int = DEFAULT_NUM_SMS
) -> W4A16Config:
    """The configuration without a tuned entry, sized for an H100 (``sms`` streaming multiprocessors).

    - M = 1 (or groups too small for a tensor-core K-tile, up to M = 16): the GEMV, 256 columns per program
      (2 warps), K split until the grid holds about four programs per SM;
    - M < ``DEQUANT_MIN_M``: the tensor-core GEMM, split-K while the tiles alone leave SMs idle, never into
      partials that move more bytes than the weight (``split_k.partials_cap``);
    - larger M: dequantize + cuBLAS.
    """
    tile_k = group_block_k(group_size)
    if m == 1 or (tile_k < 16 and m <= 16):
        cfg = W4A16Config("gemv", 1, 2 * GEMV_THREADS_COLUMNS, 128, num_warps=2, num_stages=1)
        block_k = min(cfg.block_k, tile_k)
        programs = m * -(-n // cfg.block_n)
        cfg = replace(cfg, split_k=split_count(4 * sms, programs, min(k // (2 * block_k), partials_cap(m, k, 4))))
    elif m >= DEQUANT_MIN_M or tile_k < 16:
        cfg = W4A16Config("dequant", block_n=128, block_k=64)
    else:
        wide = dtype == torch.float32
        if m <= 16:
            cfg = W4A16Config("gemm", 16, 64, 128, num_warps=4, num_stages=4)
        elif m <= 64:
            cfg = W4A16Config("gemm", 64, 64 if wide else 128, 64, num_warps=4, num_stages=4)
        else:
            cfg = W4A16Config("gemm", 128, 64 if wide else 128, 64, num_warps=8, num_stages=3)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        most = min(k // (4 * min(cfg.block_k, tile_k)), partials_cap(m, k, 4))
        cfg = replace(cfg, split_k=split_count(2 * sms, tiles, most))
    return fit_config(cfg, m, n, k, group_size)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, group_size: int) -> list[W4A16Config]:
    """The configurations ``hfaccel tune`` measures for a bucket (fitted to the shape, without repeats)."""
    tile_k = group_block_k(group_size)
    found: list[W4A16Config] = []
    if m <= 8:
        for block_n, warps in ((128, 1), (256, 1), (256, 2), (512, 2), (512, 4)):
            for block_k in (64, 128):
                for split in (1, 2, 4, 8, 16, 32):
                    found.append(W4A16Config("gemv", 1, block_n, block_k, split, warps, 1))
    if m > 1 and tile_k >= 16:
        if m <= 64:
            block_ms = {16} | ({32} if m > 16 else set()) | ({64} if m > 32 else set())
            for block_m in sorted(block_ms):
                for block_n in (64, 128):
                    for block_k, stages in ((64, 4), (128, 3)):
                        for split in (1, 2, 4, 8, 16):
                            found.append(W4A16Config("gemm", block_m, block_n, block_k, split, 4, stages))
        else:
            for block_m in (64, 128):
                for block_n in (128, 256):
                    for warps in (4, 8):
                        for split in (1, 2):
                            found.append(W4A16Config("gemm", block_m, block_n, 64, split, warps, 3))
    if m >= 64 or tile_k < 16:
        found.append(W4A16Config("dequant", block_n=128, block_k=64))
    fitted = [
        fit_config(cfg, m, n, k, group_size)
        for cfg in found
        if not (cfg.path == "gemm" and min(cfg.block_k, tile_k) < 16)
    ]
    return list(dict.fromkeys(fitted))
