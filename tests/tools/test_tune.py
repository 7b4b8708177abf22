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


@pytest.mark.slow
def test_w4a16_sweep_times_the_candidates_of_each_bucket():
    """The w4a16 sweep module on the CPU (kernels interpreted, wall-clock timing): one entry per Linear shape
    of the model, each one of that bucket's candidates, with its time."""
    import torch
    from rich.console import Console

    from hfaccel.kernels.w4a16_config import W4A16Config, candidate_configs, table_key
    from hfaccel.tools.tune import ModelShapes, available_ops, w4a16

    assert "w4a16" in available_ops() and w4a16.OP == "w4a16"
    assert w4a16.linear_shapes([ModelShapes.named("llama-3.1-8b")]) == [
        (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
    tiny = [ModelShapes("test", hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=64, vocab_size=256)]
    entries = w4a16.sweep(tiny, torch.device("cpu"), Console(quiet=True), m_buckets=(1,), dtypes=(torch.float32,),
                          reps=1)
    shapes = w4a16.linear_shapes(tiny)
    assert set(entries) == {table_key(1, n, k, torch.float32, 128) for n, k in shapes}
    for n, k in shapes:
        entry = entries[table_key(1, n, k, torch.float32, 128)]
        assert entry["us"] > 0
        assert W4A16Config.from_entry(entry) in candidate_configs(1, n, k, torch.float32, 128)
