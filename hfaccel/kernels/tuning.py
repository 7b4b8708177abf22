"""Kernel configurations tuned once per GPU, shipped as tables: ``hfaccel/kernels/configs/<gpu>.json``.

``hfaccel tune`` measures each op's candidate configurations on the present GPU for the shape buckets of named
model configs and writes the table; at run time an op asks :func:`lookup` for its bucket and falls back to its
heuristics when the table has no entry (or there is no table for this GPU: a warning once per process names
the command that makes one). A table is JSON::

    {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "date": "...", "command": "...",
     "ops": {"<op>": {"<bucket key>": {<the op's config fields>, "us": <median microseconds>}, ...}, ...}}

Bucket keys are the op's own (e.g. ``"m16_n4096_k4096_g128_dtypebfloat16"``); ops name them with :func:`bucket_key`.
A launch whose bucket was not measured takes the nearest measured one (:func:`nearest_key`): the entries that
share its exact fields (head dim, group, dtype, ...), nearest in its numeric ones (batch, context, M, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
# The GEMM routers' (w4a16, fp8) reach: a tuned entry serves its own M bucket and the ones next to it, so a table
# measured for decode's M (``hfaccel tune --m 1 --m 16``) never sends a prefill to a GEMV
NEAREST_M_RATIO = 2


def gpu_name(device: torch.device | str | None = None) -> str | None:
    """The CUDA device's name (``torch.cuda.get_device_name``), or None off CUDA."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def table_path(gpu: str) -> Path:
    """Where the table of a GPU lives: its name as a file name (``NVIDIA H100 80GB HBM3`` ->
    ``nvidia-h100-80gb-hbm3.json``)."""
    return CONFIG_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json")


def bucket_key(**fields) -> str:
    """A table key from an op's bucket fields, in the order given: ``bucket_key(m=16, n=4096)`` -> ``"m16_n4096"``."""
    return "_".join(f"{name}{_field_text(value)}" for name, value in fields.items())


def _field_text(value) -> str:
    return str(value).removeprefix("torch.")


class TableConfig:
    """What a kernel's launch-parameter dataclass shares as a table entry (its fields, plus ``us``): reading and
    writing it, and the checks every tile configuration needs. Subclasses set ``OP`` and ``PATHS``."""

    OP: str = ""
    PATHS: tuple[str, ...] = ()

    @classmethod
    def from_entry(cls, entry: dict):
        """From a table entry (the fields, plus ``us`` which is ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(entry) - known - {"us"})
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; a {cls.OP} entry has {sorted(known)} and 'us'")
        return cls(**{name: value for name, value in entry.items() if name in known})

    def entry(self) -> dict:
        return dataclasses.asdict(self)

    def check_tiles(self, powers_of_two: Sequence[str]) -> None:
        """A ValueError unless ``path`` is one of ``PATHS``, the named fields are powers of two and ``num_stages``
        is in 1..8."""
        if self.path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS}; got {self.path!r}")
        for name in powers_of_two:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1; got {value!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be an int in 1..8; got {self.num_stages!r}")

    def check_split_k(self) -> None:
        """A ValueError unless ``split_k`` (how many programs share K) is an int >= 1."""
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"split_k must be an int >= 1; got {self.split_k!r}")


class OpEntries(dict):
    """One op's entries (bucket key -> config) and the keys its nearest lookups chose, kept as long as the table
    (:func:`load_table`'s cache)."""

    def __init__(self, entries: dict):
        super().__init__(entries)
        self.chosen: dict[tuple, str | None] = {}  # (launch fields, nearest names, max ratio) -> key


@functools.cache
def load_table(gpu: str) -> dict[str, OpEntries]:
    """The ``ops`` section of a GPU's table ({} with one warning when it is missing or unreadable)."""
    path = table_path(gpu)
    try:
        table = json.loads(path.read_text())
        ops = table["ops"]
        if not isinstance(ops, dict):
            raise ValueError(f"'ops' must be an object; got {type(ops).__name__}")
        bad = sorted(op for op, entries in ops.items() if not isinstance(entries, dict))
        if bad:
            raise ValueError(f"the entries of op(s) {bad} must be an object of bucket -> config")
        return {op: OpEntries(entries) for op, entries in ops.items()}
    except FileNotFoundError:
        warnings.warn(
            f"hfaccel: no tuned kernel table for {gpu} ({path.name}); kernels use their heuristics. "
            f"`hfaccel tune` measures this GPU and writes one.",
            stacklevel=2,
        )
    except (OSError, ValueError, KeyError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        warnings.warn(
            f"hfaccel: the tuned kernel table {path} is unreadable ({error!r}); kernels use their "
            f"heuristics. `hfaccel tune` rewrites it.",
            stacklevel=2,
        )
    return {}


def lookup(op: str, key: str, device: torch.device | str | None) -> dict | None:
    """The tuned configuration of ``op`` for bucket ``key`` on ``device``'s GPU, or None (use the heuristics)."""
    gpu = gpu_name(device)
    if gpu is None:
        return None
    entry = load_table(gpu).get(op, {}).get(key)
    return dict(entry) if isinstance(entry, dict) else None


def nearest_key(
    op: str, device: torch.device | str | None, nearest: Sequence[str], /, max_ratio: int | None = None, **fields
) -> str | None:
    """The key of ``op``'s entry that serves a launch, or None (no table, or no entry shares its exact fields).

    ``fields`` are the launch's bucket fields as :func:`bucket_key` takes them (in key order); those named in
    ``nearest`` are positive ints (batch, context, M, ...), the others must match exactly (head dim, group,
    dtype, ...). The launch's own key when measured; else, among the entries with its exact fields, the one
    nearest in the ``nearest`` fields by ratio (distance in log2 space), weighed in that order (the first
    field decides, the next breaks its ties), ties toward the larger bucket; ``max_ratio``: none further than
    that ratio in any of them. Chosen once per table.
    """
    gpu = gpu_name(device)
    if gpu is None:
        return None
    entries = load_table(gpu).get(op, OpEntries({}))
    launch = {name: _field_text(value) for name, value in fields.items()}
    query = (tuple(launch.items()), tuple(nearest), max_ratio)
    if query not in entries.chosen:
        key = bucket_key(**launch)
        entries.chosen[query] = key if key in entries else _nearest(entries, launch, tuple(nearest), max_ratio)
    return entries.chosen[query]


def lookup_nearest(op: str, device: torch.device | str | None, nearest: Sequence[str], /, **fields) -> dict | None:
    """The tuned configuration of ``op`` that serves a launch (:func:`nearest_key`), or None (use the heuristics)."""
    key = nearest_key(op, device, nearest, **fields)
    return None if key is None else lookup(op, key, device)


def _nearest(entries: dict, launch: dict[str, str], nearest: tuple[str, ...], max_ratio: int | None) -> str | None:
    """The key of ``entries`` nearest to ``launch`` (field -> text) in the ``nearest`` fields (:func:`nearest_key`)."""
    names, target = list(launch), [int(launch[name]) for name in nearest]
    best: tuple[list, str] | None = None
    for key in entries:
        fields = _parse_key(key, names)
        if fields is None or any(fields[name] != text for name, text in launch.items() if name not in nearest):
            continue
        values = [_positive_int(fields[name]) for name in nearest]
        if None in values:
            continue
        rank = [(Fraction(max(v, t), min(v, t)), -v) for v, t in zip(values, target)]  # per field: ratio, larger first
        if max_ratio is not None and any(ratio > max_ratio for ratio, _ in rank):
            continue
        if best is None or rank < best[0]:
            best = (rank, key)
    return None if best is None else best[1]


def _parse_key(key: str, names: list[str]) -> dict[str, str] | None:
    """A key's field -> text for the field ``names`` in key order (``"b8_ctx1024"``, ["b", "ctx"] -> {"b": "8", "ctx":
    "1024"}), or None when its layout is another."""
    parts = key.split("_")
    if len(parts) != len(names) or not all(part.startswith(name) for part, name in zip(parts, names)):
        return None
    return {name: part[len(name) :] for part, name in zip(parts, names)}


def _positive_int(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) > 0 else None
