"""``hfaccel tune``: the table it writes (sweeps replaced by fakes: measuring needs a GPU) and its refusals."""

import importlib
import json

import pytest
import torch

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
        yield tuning.bucket_key(n=shapes[0].hidden_size), {"block_n": 64, "us": 1.5}

    path = tune.tune(models=["tiny-llama"], sweeps={"fake": sweep})
    path.write_text(json.dumps({**json.loads(path.read_text()), "ops": {"fake": {"old": {"us": 9}}, "kept": {}}}))
    tune.tune(models=["tiny-llama"], sweeps={"fake": sweep})
    table = json.loads(path.read_text())
    assert path == tmp_path / "nvidia-test-gpu.json" and seen == [["tiny-llama"]] * 2
    assert table["gpu"] == "NVIDIA Test GPU" and "kept" in table["ops"]
    assert table["ops"]["fake"] == {"old": {"us": 9}, "n256": {"block_n": 64, "us": 1.5}}
    assert tuning.lookup("fake", "n256", "cuda") == {"block_n": 64, "us": 1.5}


def test_a_sweep_stopped_part_way_keeps_the_buckets_it_measured(monkeypatch, tmp_path):
    """The table is written after every bucket: a sweep cut short (a GPU session's time limit) leaves a whole table
    with what it measured."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA Test GPU")

    def sweep(shapes, device, console):
        yield "m1", {"us": 1.0}
        yield "m2", {"us": 2.0}
        raise KeyboardInterrupt  # the session's timeout

    with pytest.raises(KeyboardInterrupt):
        tune.tune(models=["tiny-llama"], sweeps={"fake": sweep})
    table = json.loads((tmp_path / "nvidia-test-gpu.json").read_text())
    assert table["ops"]["fake"] == {"m1": {"us": 1.0}, "m2": {"us": 2.0}} and table["gpu"] == "NVIDIA Test GPU"
    assert not list(tmp_path.glob("*.partial"))


def test_m_buckets_reach_the_gemm_sweeps_only_and_dtypes_every_sweep(monkeypatch, tmp_path):
    """``--m`` restricts the M buckets of the sweeps that have them (w4a16, fp8) and leaves the others as they are,
    ``--dtype`` every sweep's dtypes; a bucket the router does not key, M buckets for attention ops only, or a dtype
    the tables do not hold are refused."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "NVIDIA Test GPU")
    asked = {}

    def gemm(shapes, device, console, *, m_buckets=(1, 2, 4), dtypes=(torch.float16, torch.bfloat16)):
        asked["gemm"] = m_buckets, dtypes
        yield from ((f"m{m}", {"us": 1.0}) for m in m_buckets)

    def attention(shapes, device, console, *, dtypes=(torch.float16, torch.bfloat16)):
        asked["attention"] = dtypes
        yield "seq64", {"us": 1.0}

    path = tune.tune(models=["tiny-llama"], sweeps={"gemm": gemm, "attention": attention}, m_buckets=[16, 1, 16])
    assert asked == {"gemm": ((1, 16), (torch.float16, torch.bfloat16)), "attention": (torch.float16, torch.bfloat16)}
    assert set(json.loads(path.read_text())["ops"]["gemm"]) == {"m1", "m16"}
    tune.tune(models=["tiny-llama"], sweeps={"gemm": gemm, "attention": attention}, dtypes=[torch.bfloat16])
    assert asked == {"gemm": ((1, 2, 4), (torch.bfloat16,)), "attention": (torch.bfloat16,)}
    with pytest.raises(ValueError, match="powers of two from 1 to 4096; got \\[3, 8192\\]"):
        tune.tune(models=["tiny-llama"], sweeps={"gemm": gemm}, m_buckets=[3, 8192, 4])
    with pytest.raises(ValueError, match="M buckets apply to the GEMM ops"):
        tune.tune(models=["tiny-llama"], sweeps={"attention": attention}, m_buckets=[1])
    with pytest.raises(ValueError, match="tuned dtypes are"):
        tune.tune(models=["tiny-llama"], sweeps={"gemm": gemm}, dtypes=[torch.float32])
    with pytest.raises(SystemExit, match="M buckets must be powers of two"):
        main(["tune", "--op", "fp8", "--m", "3", "--dtype", "bfloat16"])


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
        (4096, 4096),
        (1024, 4096),
        (14336, 4096),
        (4096, 14336),
        (128256, 4096),
    ]
    tiny = [
        ModelShapes(
            "test",
            hidden_size=128,
            intermediate_size=256,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            vocab_size=256,
        )
    ]
    entries = dict(
        w4a16.sweep(tiny, torch.device("cpu"), Console(quiet=True), m_buckets=(1,), dtypes=(torch.float32,), reps=1)
    )
    shapes = w4a16.linear_shapes(tiny)
    assert set(entries) == {table_key(1, n, k, torch.float32, 128) for n, k in shapes}
    for n, k in shapes:
        entry = entries[table_key(1, n, k, torch.float32, 128)]
        assert entry["us"] > 0
        assert W4A16Config.from_entry(entry) in candidate_configs(1, n, k, torch.float32, 128)


def test_attention_sweeps_measure_candidates_into_the_keys_the_kernels_read(monkeypatch):
    """The two attention sweeps run end to end on small shapes (the kernels through the interpreter on the CPU;
    timings mean nothing here): every entry is one of the op's candidates, under the key a launch looks up."""
    from rich.console import Console

    from hfaccel.tools.tune import flash_attention as flash_sweep
    from hfaccel.tools.tune import paged_attention as paged_sweep

    flash_attention = importlib.import_module("hfaccel.kernels.flash_attention")
    paged_attention = importlib.import_module("hfaccel.kernels.paged_attention")

    shapes = [tune.ModelShapes.named("tiny-llama")]  # 8 query heads over 2 KV heads, head dim 32
    console = Console(quiet=True)
    monkeypatch.setattr(flash_sweep, "SEQ_BUCKETS", (64,))
    monkeypatch.setattr(flash_sweep, "TOKENS", 64)  # batch 1
    flash = dict(flash_sweep.sweep(shapes, torch.device("cpu"), console, dtypes=(torch.float16,)))
    entry = flash[flash_attention.table_key(32, 4, 64, torch.float16)]
    assert len(flash) == 1 and entry["us"] > 0 and entry["sdpa_us"] > 0
    fields = {k: v for k, v in entry.items() if k not in ("us", "sdpa_us")}
    assert flash_attention.FlashConfig(**fields) in flash_attention.candidate_configs(32, torch.float16)

    monkeypatch.setattr(paged_sweep, "BATCHES", (2,))
    monkeypatch.setattr(paged_sweep, "CONTEXTS", (300,))
    paged = dict(paged_sweep.sweep(shapes, torch.device("cpu"), console, dtypes=(torch.float16,)))
    entry = paged[paged_attention.table_key(32, 4, 2, 300, torch.float16)]
    assert len(paged) == 1 and entry["us"] > 0 and entry["num_splits"] in paged_sweep.split_candidates(2, 300)
    candidates = paged_attention.candidate_paged_configs(32, torch.float16, 4)
    tiles = {(c.block_n, c.num_warps, c.num_stages) for c in candidates}
    assert (entry["block_n"], entry["num_warps"], entry["num_stages"]) in tiles


def test_fp8_sweep_measures_candidates_into_the_keys_the_router_reads(tuned_table):
    """The fp8 sweep on the CPU (kernels interpreted, wall-clock timing): one entry per Linear shape and M bucket,
    each one of that bucket's candidates (W8A8 tiles among them), and the router serves it from the table."""
    from rich.console import Console

    from hfaccel.kernels.fp8_config import Fp8Config, candidate_configs, pick_fp8_config, table_key
    from hfaccel.tools.tune import ModelShapes, available_ops, fp8

    assert "fp8" in available_ops() and fp8.OP == "fp8"
    assert fp8.layouts(4096, 14336) == [(14336, 1), (128, 128)] and fp8.layouts(77, 200) == [(200, 1)]
    tiny = [
        ModelShapes(
            "test",
            hidden_size=128,
            intermediate_size=256,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            vocab_size=256,
        )
    ]
    entries = dict(
        fp8.sweep(
            tiny,
            torch.device("cpu"),
            Console(quiet=True),
            m_buckets=(1, 32),
            dtypes=(torch.bfloat16,),
            blocks=False,
            reps=1,
        )
    )
    shapes = fp8.linear_shapes(tiny)
    assert set(entries) == {table_key(m, n, k, torch.bfloat16, k, 1) for n, k in shapes for m in (1, 32)}
    for key, entry in entries.items():
        m, n, k = (int(part[1:]) for part in key.split("_")[:3])
        config = Fp8Config.from_entry(entry)
        assert entry["us"] > 0 and config in candidate_configs(m, k, torch.bfloat16, k)
    tuned_table({"fp8": entries})
    n, k = shapes[0]
    assert pick_fp8_config(32, n, k, torch.bfloat16, k, 1, "cuda") == Fp8Config.from_entry(
        entries[table_key(32, n, k, torch.bfloat16, k, 1)]
    )


def test_a_latent_models_decode_is_tuned_at_its_latent_width():
    """DeepSeek-V2-Lite decodes over its latents (512 + 64 read as one KV head 576 wide, ``hfaccel.kv.latent``) and
    prefills over the K/V it expands (keys 128 + 64): the paged sweep takes the first, the prefill the second."""
    shapes = tune.ModelShapes.named("deepseek-v2-lite")
    assert shapes.decode_attention == (16, 1, 576, True)  # one row read as keys and values
    assert (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim) == (16, 16, 192)
    assert tune.ModelShapes.named("llama-3.1-8b").decode_attention == (32, 8, 128, False)
