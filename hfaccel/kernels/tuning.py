"""Kernel configurations tuned once per GPU, shipped as tables: ``hfaccel/kernels/configs/<gpu>.json``.

``hfaccel tune`` measures each op's candidate configurations on the present GPU for the shape buckets of named
model configs and writes the table; at run time an op asks :func:`lookup` for its bucket and falls back to its
heuristics when the table has no entry (or there is no table for this GPU: a warning once per process names
the command that makes one). A table is JSON::

    {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "date": "...", "command": "...",
     "ops": {"<op>": {"<bucket key>": {<the op's config fields>, "us": <median microseconds>}, ...}, ...}}

Bucket keys are the op's own (e.g. ``"m16_n4096_k4096_bfloat16_g128"``); ops name them with :func:`bucket_key`.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


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
    return "_".join(f"{name}{str(value).removeprefix('torch.')}" for name, value in fields.items())


@functools.cache
def load_table(gpu: str) -> dict:
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
        return ops
    except FileNotFoundError:
        warnings.warn(f"hfaccel: no tuned kernel table for {gpu} ({path.name}); kernels use their heuristics. "
                      f"`hfaccel tune` measures this GPU and writes one.", stacklevel=2)
    except (OSError, ValueError, KeyError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"hfaccel: the tuned kernel table {path} is unreadable ({error!r}); kernels use their "
                      f"heuristics. `hfaccel tune` rewrites it.", stacklevel=2)
    return {}


def lookup(op: str, key: str, device: torch.device | str | None) -> dict | None:
    """The tuned configuration of ``op`` for bucket ``key`` on ``device``'s GPU, or None (use the heuristics)."""
    gpu = gpu_name(device)
    if gpu is None:
        return None
    entry = load_table(gpu).get(op, {}).get(key)
    return dict(entry) if isinstance(entry, dict) else None
