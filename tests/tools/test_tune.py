"""``hfaccel tune``: the table it writes (sweeps replaced by fakes: measuring needs a GPU) and its refusals."""

import json

import pytest

from hfaccel.kernels import tuning
from hfaccel.tools import tune
from hfaccel.tools.cli import main


def test_tune_needs_a_cuda_gpu():
    with pytest.raises(ValueError, match="on a CUDA GPU; got device cpu"):
        tune.tune(device="cpu")
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main(["tune", "--device", "cpu"])


def test_tune_merges_the_sweeps_into_the_gpu_table(monkeypatch, tmp_path):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA Test GPU")
    seen = []

    def sweep(shapes, device, console):
        seen.append([s.name for s in shapes])
        return {tuning.bucket_key(n=shapes[0].hidden_size): {"block_n": 64, "us": 1.5}}

    path = tune.tune(models=["tiny-llama"], sweeps={"fake": sweep})
    path.write_text(json.dumps({**json.loads(path.read_text()), "ops": {"fake": {"old": {"us": 9}}, "kept": {}}}))
    tune.tune(models=["tiny-llama"], sweeps={"fake": sweep})
    table = json.loads(path.read_text())
    assert path == tmp_path / "nvidia-test-gpu.json" and seen == [["tiny-llama"]] * 2
    assert table["gpu"] == "NVIDIA Test GPU" and "kept" in table["ops"]
    assert table["ops"]["fake"] == {"old": {"us": 9}, "n256": {"block_n": 64, "us": 1.5}}
    assert tuning.lookup("fake", "n256", "cuda") == {"block_n": 64, "us": 1.5}


def test_unknown_ops_and_models_are_refused(monkeypatch):
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA Test GPU")
    with pytest.raises(ValueError, match="unknown op"):
        tune.tune(ops=["nope"])
    with pytest.raises(ValueError, match="model must be one of"):
        tune.tune(models=["gpt-9"], sweeps={})
