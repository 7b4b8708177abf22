"""``hfaccel tune``: measure each kernel's candidate configurations on this GPU and write its table.

The table (``hfaccel/kernels/configs/<gpu>.json``, see ``hfaccel.kernels.tuning``) holds, per op and shape
bucket, the fastest configuration measured. Each tunable op has a module ``hfaccel/tools/tune/<op>.py`` with

    OP: str                                      # the op's name in the table
    def sweep(shapes: list[ModelShapes], device: torch.device, console) -> Iterator[tuple[str, dict]]
        # (bucket key, the winning config's fields plus "us": median microseconds), as each bucket is measured;
        # every sweep also takes dtypes=, the GEMM ops' m_buckets=

``tune`` runs the sweeps of the ops asked for (default: every module here) over the named model configs and
merges the results into the GPU's table, keeping entries of ops it did not run. The table is written after every
bucket, so a sweep stopped part way (a GPU session's time limit) keeps what it measured. A GPU session runs it once
and commits the table; every other session builds on it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console

from hfaccel.kernels import tuning
from hfaccel.kv.layout import AttentionKV
from hfaccel.tools.models import NAMED_CONFIGS

DEFAULT_MODELS = ("llama-3.2-1b", "llama-3.1-8b")
TUNED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ModelShapes:
    """The dimensions of a named model config that set kernel shapes."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # the paged decode's KV heads and head dim where they differ (MLA read in the latent space: one head of the two
    # latents joined, hfaccel.kv.latent)
    decode_kv_heads: int | None = None
    decode_head_dim: int | None = None

    @classmethod
    def named(cls, name: str) -> ModelShapes:
        if name not in NAMED_CONFIGS:
            raise ValueError(f"model must be one of {sorted(NAMED_CONFIGS)}; got {name!r}")
        c = NAMED_CONFIGS[name]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        decode = {}
        if "kv_lora_rank" in c:  # multi-head latent attention: prefill over the expanded K/V, decode over the latents
            head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            latent = AttentionKV(
                1,
                c["kv_lora_rank"],
                c["qk_rope_head_dim"],
                expanded_dim=head_dim,
                indexer_dim=c.get("index_head_dim", 0),
            )  # (a sparse-attention model's indexer keys in the same rows)
            decode = dict(decode_kv_heads=1, decode_head_dim=2 * latent.width)
        return cls(
            name,
            c["hidden_size"],
            c["intermediate_size"],
            c["num_hidden_layers"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            head_dim,
            c["vocab_size"],
            **decode,
        )

    @property
    def decode_attention(self) -> tuple[int, int, int, bool]:
        """(query heads, KV heads, head dim, whether one row is read as keys and values: MLA's latents) of the paged
        decode."""
        heads, kv_heads = self.num_heads, self.decode_kv_heads or self.num_kv_heads
        return heads, kv_heads, self.decode_head_dim or self.head_dim, self.decode_head_dim is not None


def available_ops() -> list[str]:
    """The ops with a sweep module in this package."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def tune(
    models: Sequence[str] = DEFAULT_MODELS,
    ops: Sequence[str] | None = None,
    device: str = "cuda",
    output: str | Path | None = None,
    console: Console | None = None,
    sweeps: dict[str, Callable[..., Iterable[tuple[str, dict]]]] | None = None,
    m_buckets: Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> Path:
    """Sweep the ops' configurations for the models' shapes on ``device`` (a CUDA GPU) and write the table after
    each bucket; returns its path. ``m_buckets`` (powers of two, 1 to 4096) restricts the GEMM ops' (w4a16, fp8) M
    buckets, e.g. to decode's, and ``dtypes`` every op's activation dtypes (a lent GPU's minutes go further);
    ``sweeps`` (op -> sweep function) replaces the op modules (tests)."""
    console = console or Console()
    dev = torch.device(device)
    gpu = tuning.gpu_name(dev)
    if gpu is None:
        raise ValueError(f"hfaccel tune measures kernels on a CUDA GPU; got device {dev} (no CUDA GPU here)")
    shapes = [ModelShapes.named(name) for name in models]
    sweeps = sweeps if sweeps is not None else _sweeps(ops)
    options = _sweep_options(sweeps, m_buckets, dtypes)
    path = Path(output) if output is not None else tuning.table_path(gpu)
    table = _existing(path)
    import triton

    table.update(gpu=gpu, torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv))
    for op, sweep in sweeps.items():
        console.print(f"tuning {op} for {', '.join(models)} on {gpu}")
        entries = table["ops"].setdefault(op, {})
        for key, entry in sweep(shapes, dev, console, **options.get(op, {})):
            entries[key] = entry
            _write(path, table)
    _write(path, table)
    console.print(f"wrote {path}")
    return path


def _sweep_options(
    sweeps: dict[str, Callable], m_buckets: Sequence[int] | None, dtypes: Sequence[torch.dtype] | None
) -> dict[str, dict]:
    """Each sweep's keywords: ``m_buckets=`` for the sweeps that take one, ``dtypes=``. A ValueError for an M that
    is not a bucket the router keys (a power of two, 1 to 4096), M buckets where no op asked for has them, or a
    dtype other than the 16-bit ones the tables hold."""
    from hfaccel.kernels.w4a16_config import M_BUCKETS

    options: dict[str, dict] = {op: {} for op in sweeps}
    if m_buckets is not None:
        bad = sorted(set(m_buckets) - set(M_BUCKETS))
        if bad:
            raise ValueError(f"M buckets must be powers of two from 1 to {M_BUCKETS[-1]}; got {bad}")
        takes = [op for op, sweep in sweeps.items() if "m_buckets" in inspect.signature(sweep).parameters]
        if not takes:
            raise ValueError(f"M buckets apply to the GEMM ops (w4a16, fp8); none of {sorted(sweeps)} has them")
        for op in takes:
            options[op]["m_buckets"] = tuple(sorted(set(m_buckets)))
    if dtypes is not None:
        bad = [str(d) for d in dtypes if d not in TUNED_DTYPES]
        if bad:
            raise ValueError(f"tuned dtypes are {[str(d) for d in TUNED_DTYPES]}; got {bad}")
        for op in options:
            options[op]["dtypes"] = tuple(dict.fromkeys(dtypes))
    return options


def _write(path: Path, table: dict) -> None:
    """The table at ``path``, replaced whole (never half written), dated now; the tables' cache cleared."""
    table["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)
    tuning.load_table.cache_clear()


def _sweeps(ops: Sequence[str] | None) -> dict[str, Callable]:
    known = available_ops()
    unknown = sorted(set(ops or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; tunable ops: {known}")
    modules = [importlib.import_module(f"{__name__}.{op}") for op in (ops or known)]
    return {module.OP: module.sweep for module in modules}


def _existing(path: Path) -> dict:
    """The table already at ``path`` (so ops not re-tuned keep their entries), or an empty one."""
    try:
        table = json.loads(path.read_text())
        if isinstance(table, dict) and isinstance(table.get("ops"), dict):
            return table
    except (OSError, ValueError):
        pass
    return {"ops": {}}
