"""What every benchmark case shares: timing, bandwidth, the run's environment, and result tables."""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import torch
from rich.table import Table

from hfaccel.runner.graphs import routed_expert_banks

Run = TypeVar("Run")


def median_run(runs: Sequence[Run], speed: Callable[[Run], float]) -> Run:
    """The run of median ``speed`` (of two, the slower: a serving benchmark's figure is never its luckier run)."""
    return sorted(runs, key=speed)[(len(runs) - 1) // 2]


def interleaved_runs(runs: Mapping[Hashable, Callable[[], Run]], speed: Callable[[Run], float]) -> dict:
    """Each of ``runs`` once untimed (compiles, captures, warm caches), then twice timed in the order A B C C B A —
    so that none is favoured by going first or last — and the :func:`median_run` of each: ``{key: run}``."""
    for run in runs.values():
        run()
    timed: dict[Hashable, list] = {key: [] for key in runs}
    for key in list(runs) + list(runs)[::-1]:
        timed[key].append(runs[key]())
    return {key: median_run(results, speed) for key, results in timed.items()}


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 5, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA (``warmup`` and ``rep`` milliseconds; the L2 cache
    is flushed before each call), wall clock over ``reps`` runs elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graph_time_ms(fn: Callable[[], object], device: torch.device, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph (the GPU time alone, without the host work of an
    eager call: what a captured decode step pays; ``rep``: about the milliseconds each timed replay runs, the calls
    captured in it being about ``rep`` / the time of one); :func:`time_ms` off CUDA."""
    if device.type != "cuda":
        return time_ms(fn, device)
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def l2_cold_copies(nbytes: int, device: torch.device) -> int:
    """How many distinct copies of ``nbytes`` of operands a replay must take in turn so that each call reads its
    operands from HBM rather than from the L2 the calls before left them in: together at least twice the L2 (at
    most 64; 1 off CUDA)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(64, -(-2 * l2 // max(nbytes, 1))))


def cold_graph_time_ms(
    calls: Sequence[Callable[[], object]], device: torch.device, reps: int = 5, rep: int = 100
) -> float:
    """Median milliseconds of one of ``calls`` — the same op over distinct copies of its operands, enough of them
    (:func:`l2_cold_copies`) that each call finds its operands in HBM, as a decode step finds its weights — replayed
    in turn from one CUDA graph: the GPU's time alone. An eager call's host work (Python, allocations, the launch)
    can outlast a small kernel and would be timed with it (``rep`` as in :func:`graph_time_ms`). :func:`time_ms` of
    the first call (``reps`` runs) off CUDA."""
    if device.type != "cuda":
        return time_ms(calls[0], device, reps=reps)

    def in_turn() -> None:
        for call in calls:
            call()

    return graph_time_ms(in_turn, device, rep) / len(calls)


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy (bytes read + written), the practical roofline of a memory-bound kernel."""
    numel = (256 << 20) if device.type == "cuda" else (16 << 20)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / time_ms(lambda: dst.copy_(src), device) / 1e6


def read_bandwidth(device: torch.device) -> float:
    """GB/s of a read-only kernel (a sum over a large buffer): the roofline of a kernel that reads its operands
    once — a decode step's weights, a GEMV's packed weights, a paged kernel's K/V. (A copy also writes what it
    reads, so its bytes over time undercount what reading alone reaches.)"""
    numel = (256 << 20) if device.type == "cuda" else (16 << 20)
    src = torch.randn(numel, device=device)
    return src.numel() * src.element_size() / time_ms(lambda: src.sum(), device) / 1e6


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the elements of ``tensors``, each counted as given."""
    return sum(t.numel() * t.element_size() for t in tensors)


def experts_per_token(config) -> int:
    """How many experts a model routes each token to, by its text config ``config`` (0: none said)."""
    text = config.get_text_config(decoder=True)
    names = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token")
    return next((k for k in (getattr(text, name, None) for name in names) if k), 0)


def weight_read_bytes(model: torch.nn.Module, tokens: int = 1) -> float:
    """Bytes a decode step of ``tokens`` tokens reads from the model's weights: every parameter and buffer once
    (tied or shared tensors once; int4 layers count their packed weights, scales and zeros), except the input
    embedding table when it is not also the output projection — a decode step reads only its batch's rows of it.
    Of the expert banks that read only routed experts (:func:`~hfaccel.runner.graphs.routed_expert_banks`), the
    share the tokens reach when each picks its ``k`` of ``E`` uniformly, ``1 - (1 - k / E) ** tokens`` (what
    random-weight routers do; real ones may gather on fewer; a padded batch's padding rows not counted)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    embed, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is None or output.weight.data_ptr() != embed.weight.data_ptr():
        tensors.pop(embed.weight.data_ptr(), None)
    k = experts_per_token(model.config)
    for bank in routed_expert_banks(model) if k else ():
        reached = 1 - (1 - min(k, bank.num_experts) / bank.num_experts) ** tokens
        for tensor in bank.parameters(recurse=False):
            if tensor.data_ptr() in tensors and tensor.shape[0] == bank.num_experts:
                tensors[tensor.data_ptr()] *= reached
    return sum(tensors.values())


def read_ms(nbytes: int, gb_per_s: float) -> float:
    """Milliseconds one read of ``nbytes`` takes at ``gb_per_s`` (e.g. :func:`read_bandwidth`): a roofline."""
    return nbytes / (gb_per_s * 1e9) * 1e3


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict:
    import transformers
    import triton

    import hfaccel

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton.__version__,
        "hfaccel": hfaccel.__version__,
        "commit": commit or None,
        "command": " ".join(sys.argv),
    }


def row_line(row: object) -> str:
    """One result row (a dataclass) as a line, printed as soon as it is measured: a run cut short by its time limit
    or by a crash still leaves the rows before, and the grid's order tells which row it died in."""
    return "  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in asdict(row).items())


def table(title: str, rows: list[dict]) -> Table:
    """A rich table of result rows (dicts with the same keys; none: the title alone)."""
    result = Table(title=title)
    for key in rows[0] if rows else ():
        result.add_column(key, justify="left" if isinstance(rows[0][key], str) else "right")
    for row in rows:
        result.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    return result
