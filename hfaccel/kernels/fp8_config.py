"""Which path and tiles serve an fp8 product ``x [M, K] @ dequant(W) [K, N]``: the router of ``fp8_matmul``.

Four paths (``hfaccel.kernels.fp8``): ``gemv`` (decode rows, fp32 FMAs), ``gemm`` (16-bit tensor cores, the weight
converted exactly), ``w8a8`` (activations quantized per token — per token and K group for block weights — and fp8
tensor cores; a GPU of sm_89 or later, 16-bit activations) and ``dequant`` (the weight dequantized, then the dense
matmul).

A call asks :func:`pick_fp8_config`: the tuned table of the present GPU (``hfaccel tune --op fp8``; M rounded up to
a power of two, a measured M next to it when its own was not) or, without an entry, the heuristics. Weight-only paths
keep the activations' precision; ``w8a8`` rounds them to e4m3 as vLLM's and transformers' fp8 kernels do, so on a GPU
it serves large M only, and never off CUDA (the CPU keeps the weight-only paths' results).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import dataclass, replace

import torch

from hfaccel.kernels import tuning
from hfaccel.kernels.runtime import DEFAULT_NUM_SMS, num_sms
from hfaccel.kernels.split_k import fit_split, partials_cap, split_count

OP = "fp8"
PATHS = ("gemv", "gemm", "w8a8", "dequant")
M_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096
GEMV_MAX_M = 8  # heuristic: rows of x served by the GEMV (decode and small batches)
W8A8_MIN_M = 128  # heuristic: from this M on a GPU, fp8 tensor cores (the activations quantized per token)
DEQUANT_MIN_M = 1024  # heuristic: from this M (off the w8a8 path) the dense matmul of the dequantized weight
W8A8_DTYPES = (torch.float16, torch.bfloat16)  # activations the w8a8 path takes (its output dtype)
SPLITS = (1, 2, 4, 8, 16, 32)  # split-K counts the tuner measures (fitted to K's tiles)


@dataclass(frozen=True)
class Fp8Config(tuning.TableConfig):
    """A path and its launch parameters; ``block_k`` lies in one K group of the scales (:func:`fit_config`);
    ``split_k`` programs share K on the tiled paths (``hfaccel.kernels.split_k``: deterministic)."""

    path: str
    block_m: int = 16  # gemm and w8a8 (gemv programs take one row)
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    OP, PATHS = OP, PATHS

    def __post_init__(self):
        self.check_tiles(("block_m", "block_n", "block_k", "num_warps"))
        self.check_split_k()
        if self.path in ("gemm", "w8a8") and (self.block_m < 16 or self.block_k < min_block_k(self.path)):
            raise ValueError(
                f"a {self.path} tile needs block_m >= 16 and block_k >= {min_block_k(self.path)} (the "
                f"smallest tensor-core tile); got {self}"
            )

    @property
    def label(self) -> str:
        """Short form for tables and logs: ``w8a8 128x128x128 split 2, 8 warps, 3 stages``."""
        if self.path == "dequant":
            return "dequant + dense matmul"
        rows = self.block_m if self.path != "gemv" else 1
        return (
            f"{self.path} {rows}x{self.block_n}x{self.block_k} split {self.split_k}, "
            f"{self.num_warps} warps, {self.num_stages} stages"
        )


def min_block_k(path: str) -> int:
    """The smallest K tile of a path: fp8 tensor-core instructions take K = 32, 16-bit ones 16."""
    return 32 if path == "w8a8" else 16 if path == "gemm" else 8


def bucket_m(m: int) -> int:
    """M rounded up to a power of two, capped at the largest bucket."""
    return next((b for b in M_BUCKETS if b >= m), M_BUCKETS[-1])


def groups_text(k: int, n: int, group_k: int, group_n: int) -> str:
    """The scales' layout in a table key: ``channel``, ``tensor``, or ``128x128`` blocks."""
    if group_k >= k:
        return "tensor" if group_n >= n else "channel" if group_n == 1 else f"{k}x{group_n}"
    return f"{group_k}x{group_n}"


def bucket_fields(m: int, n: int, k: int, dtype: torch.dtype, group_k: int, group_n: int) -> dict:
    """The tuned table's bucket of a call (in key order)."""
    return dict(m=bucket_m(m), n=n, k=k, g=groups_text(k, n, group_k, group_n), dtype=dtype)


def table_key(m: int, n: int, k: int, dtype: torch.dtype, group_k: int, group_n: int) -> str:
    """The table key of a call: ``m16_n4096_k4096_gchannel_dtypebfloat16``."""
    return tuning.bucket_key(**bucket_fields(m, n, k, dtype, group_k, group_n))


def group_block_k(k: int, group_k: int, block_k: int) -> int:
    """``block_k`` cut to lie in one K group: a power of two dividing ``group_k`` (any, with one group)."""
    if group_k >= k:
        return block_k
    return min(block_k, group_k & -group_k)


def fit_config(config: Fp8Config, k: int, group_k: int) -> Fp8Config:
    """``config`` with its K tile inside one group and no more splits than K tiles (none for ``dequant``); a
    ValueError when the path cannot keep a tile that small."""
    if config.path == "dequant":
        return replace(config, split_k=1)
    block_k = group_block_k(k, group_k, config.block_k)
    if block_k < min_block_k(config.path):
        raise ValueError(
            f"fp8 K groups of {group_k} are not a multiple of {min_block_k(config.path)} (the smallest "
            f"K tile of the {config.path} path)"
        )
    return replace(config, block_k=block_k, split_k=fit_split(config.split_k, k, block_k))


def w8a8_runs(dtype: torch.dtype, device: torch.device | str | None) -> bool:
    """Whether the heuristics may route to ``w8a8``: 16-bit activations on a CUDA GPU with fp8 tensor cores."""
    device = torch.device(device if device is not None else "cpu")
    return (
        dtype in W8A8_DTYPES
        and device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def pick_fp8_config(
    m: int, n: int, k: int, dtype: torch.dtype, group_k: int, group_n: int, device: torch.device | str | None = None
) -> Fp8Config:
    """The configuration of a call: the tuned table's entry for its bucket on ``device``'s GPU (or a measured M's
    next to it: ``tuning.NEAREST_M_RATIO``), else the heuristics (an entry that is malformed or cannot serve the
    shape warns and is not used)."""
    key = tuning.nearest_key(
        OP, device, ("m",), max_ratio=tuning.NEAREST_M_RATIO, **bucket_fields(m, n, k, dtype, group_k, group_n)
    )
    entry = None if key is None else tuning.lookup(OP, key, device)
    if entry is not None:
        try:
            config = _tuned_config(tuple(sorted(entry.items())), k, group_k)
            if config.path != "w8a8" or dtype in W8A8_DTYPES:
                return config
            raise ValueError(f"w8a8 takes {W8A8_DTYPES} activations, not {dtype}")
        except (TypeError, ValueError) as error:
            _warn_bad_entry(key, str(error))
    return heuristic_config(m, n, k, dtype, group_k, w8a8_runs(dtype, device), num_sms(device))


@functools.lru_cache(maxsize=4096)
def _tuned_config(entry: tuple, k: int, group_k: int) -> Fp8Config:
    return fit_config(Fp8Config.from_entry(dict(entry)), k, group_k)


@functools.cache
def _warn_bad_entry(key: str, error: str) -> None:
    warnings.warn(
        f"hfaccel: the tuned fp8 entry {key} is unusable ({error}); using the heuristics. "
        f"`hfaccel tune --op fp8` rewrites it.",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=4096)
def heuristic_config(
    m: int, n: int, k: int, dtype: torch.dtype, group_k: int, w8a8: bool = False, sms: int = DEFAULT_NUM_SMS
) -> Fp8Config:
    """The configuration without a tuned entry, sized for ``sms`` streaming multiprocessors: the GEMV up to
    ``GEMV_MAX_M`` rows (K split until the grid holds about four programs per SM), fp8 tensor cores from
    ``W8A8_MIN_M`` where ``w8a8`` may serve, the dense matmul of the dequantized weight from ``DEQUANT_MIN_M``, the
    16-bit tensor-core GEMM between (a block size that does not fit a K tile of 16 takes the dequantized weight); the
    tensor-core tiles split K while they alone leave SMs idle, never into partials that move more bytes than the
    weight (``split_k.partials_cap``)."""
    if m <= GEMV_MAX_M:
        config = fit_config(Fp8Config("gemv", block_n=64, block_k=64), k, group_k)
        programs = m * -(-n // config.block_n)
        most = min(k // (2 * config.block_k), partials_cap(m, k, 8))
        return replace(config, split_k=split_count(4 * sms, programs, most))
    if w8a8 and m >= W8A8_MIN_M and group_block_k(k, group_k, 128) >= min_block_k("w8a8"):
        config = fit_config(Fp8Config("w8a8", block_m=128, block_n=128, block_k=128, num_warps=8), k, group_k)
    elif m >= DEQUANT_MIN_M or group_block_k(k, group_k, 64) < min_block_k("gemm"):
        return Fp8Config("dequant")
    else:
        config = fit_config(Fp8Config("gemm", block_m=16 if m <= 16 else 64, block_n=64, block_k=64), k, group_k)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    most = min(k // (4 * config.block_k), partials_cap(m, k, 8))
    return replace(config, split_k=split_count(2 * sms, tiles, most))


def candidate_configs(m: int, k: int, dtype: torch.dtype, group_k: int) -> list[Fp8Config]:
    """The configurations ``hfaccel tune`` measures for a bucket (fitted to the shape, those that fit, no repeats)."""
    found = []
    if m <= 2 * GEMV_MAX_M:
        found += [
            Fp8Config("gemv", block_n=n, block_k=bk, num_warps=w, num_stages=1, split_k=split)
            for n in (64, 128, 256)
            for bk in (64, 128)
            for w in (2, 4)
            for split in SPLITS
        ]
    tiles = [
        (16, 64, 64),
        (16, 128, 128),
        (32, 64, 128),
        (64, 64, 64),
        (64, 128, 64),
        (64, 128, 128),
        (128, 128, 64),
        (128, 128, 128),
        (128, 256, 64),
    ]
    splits = SPLITS[:5] if m <= 256 else SPLITS[:4]  # the heuristics' splits (a split count compiles nothing new)
    for bm, bn, bk in tiles:
        if bm > 2 * m and bm > 16:
            continue  # a tile mostly padding
        for (warps, stages), split in itertools.product(((4, 3), (8, 3)), splits):
            found.append(Fp8Config("gemm", bm, bn, bk, warps, stages, split))
            if dtype in W8A8_DTYPES:
                found.append(Fp8Config("w8a8", bm, bn, bk, warps, stages, split))
    found.append(Fp8Config("dequant"))
    fitted = []
    for config in found:
        try:
            fitted.append(fit_config(config, k, group_k))
        except ValueError:
            continue
    return list(dict.fromkeys(fitted))
