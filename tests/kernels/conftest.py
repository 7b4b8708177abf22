"""Fixtures of the kernel tests."""

import pytest

from hfaccel.kernels import tuning


@pytest.fixture
def gpu_table(monkeypatch, tmp_path):
    """The path of the tuned table of a fake GPU, "NVIDIA Test GPU 80GB", that every device resolves to (only the
    table lookups run; nothing launches on it)."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA Test GPU 80GB")
    tuning.load_table.cache_clear()
    yield tmp_path / "nvidia-test-gpu-80gb.json"
    tuning.load_table.cache_clear()
