"""Which path served an attention call, and the per-model count of them (``model.hfaccel.attention_paths``)."""

from __future__ import annotations

from collections import Counter

import torch

from hfaccel.kernels.runtime import resolve_backend

# What served a call, as AttentionPaths counts it.
SDPA, FLASH, PAGED, TORCH = "sdpa", "hfaccel flash", "hfaccel paged", "torch"
ABSORBED = "hfaccel paged latent"  # the paged kernel over a latent layer's latents (``hfaccel.kv.latent``)
SPARSE = "torch sparse"  # the keys a sparse-attention indexer chose for each query, by exact torch attention
PATHS_ATTRIBUTE = "hfaccel_attention_paths"  # where a tracked model's attention modules keep their AttentionPaths


class AttentionPaths:
    """How many eager attention calls of one model each path served (``sdpa``; hfaccel's ``flash`` or ``paged``
    kernel, with the backend that ran it: ``triton`` or the ``torch`` reference; ``torch`` for the exact fallbacks),
    and the last one. Calls inside a ``torch.compile``d step are not counted: their path was fixed when the step
    was traced (decode steps: the paged kernel)."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.last: str | None = None

    def record(self, path: str) -> None:
        self.counts[path] += 1
        self.last = path

    def __str__(self) -> str:
        if not self.counts:
            return "no eager attention call yet"
        calls = ", ".join(f"{path} {count}" for path, count in self.counts.most_common())
        return f"{calls} (last: {self.last})"

    def __repr__(self) -> str:
        return f"AttentionPaths({dict(self.counts)}, last={self.last!r})"


def record_path(
    module: torch.nn.Module, path: str, backend: str | None = None, query: torch.Tensor | None = None
) -> None:
    """Count the path in the module's AttentionPaths (a model that ``accelerate`` tracks; eager calls only).
    hfaccel's kernels are named with the backend that runs them (``hfaccel flash (triton)``)."""
    if torch.compiler.is_compiling():
        return
    paths = getattr(module, PATHS_ATTRIBUTE, None)
    if paths is not None:
        paths.record(path if backend is None else f"{path} ({resolve_backend(backend, query.device)})")
