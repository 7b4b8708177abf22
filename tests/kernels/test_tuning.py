"""Per-GPU tuned tables: read once, looked up by bucket (or the nearest measured one); a missing or corrupt table means
heuristics + a warning."""

import importlib
import itertools
import json

import pytest
import torch

from hfaccel.kernels import tuning
from hfaccel.kernels.flash_attention import FlashConfig
from hfaccel.kernels.paged_attention import PagedConfig
from hfaccel.kernels.w4a16_config import (
    M_BUCKETS,
    W4A16Config,
    candidate_configs,
    fit_config,
    heuristic_config,
    pick_w4a16_config,
)
from hfaccel.kernels.w4a16_config import table_key as w4a16_key
from hfaccel.runner.graphs import DEFAULT_LADDER
from hfaccel.tools.tune import ModelShapes
from hfaccel.tools.tune import flash_attention as flash_sweep
from hfaccel.tools.tune import paged_attention as paged_sweep
from hfaccel.tools.tune import w4a16 as w4a16_sweep


def test_table_path_is_the_gpu_name_as_a_file_name():
    assert tuning.table_path("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"
    assert tuning.bucket_key(m=16, n=4096, dtype="torch.bfloat16") == "m16_n4096_dtypebfloat16"


def test_lookup_reads_the_table_once(gpu_table):
    entry = {"block_n": 64, "us": 3.5}
    gpu_table.write_text(json.dumps({"gpu": "NVIDIA Test GPU 80GB", "ops": {"w4a16": {"m1_n7": entry}}}))
    assert tuning.lookup("w4a16", "m1_n7", "cuda") == {"block_n": 64, "us": 3.5}
    assert tuning.lookup("w4a16", "m2_n7", "cuda") is None and tuning.lookup("paged", "m1_n7", "cuda") is None
    gpu_table.unlink()
    assert tuning.lookup("w4a16", "m1_n7", "cuda") == {"block_n": 64, "us": 3.5}  # cached per process


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no tuned kernel table"),
        ("{not json", "unreadable"),
        ('{"ops": [1, 2]}', "unreadable"),
        ('{"gpu": "x"}', "unreadable"),
        ('{"ops": {"w4a16": [1]}}', "unreadable"),
    ],
)
def test_missing_or_corrupt_table_warns_and_falls_back(gpu_table, content, message):
    if content is not None:
        gpu_table.write_text(content)
    with pytest.warns(UserWarning, match=message):
        assert tuning.lookup("w4a16", "m1_n7", "cuda") is None


def test_no_table_off_cuda():
    assert tuning.gpu_name("cpu") is None and tuning.lookup("w4a16", "m1_n7", "cpu") is None


# ---- the nearest measured bucket: what a launch the table lacks reads --------------------------------------------
paged_module = importlib.import_module("hfaccel.kernels.paged_attention")
flash_module = importlib.import_module("hfaccel.kernels.flash_attention")
MAX_MODEL_LENS = (256, 1000, 4096, 8192, 40000, 131072)  # what a captured decode step sizes its paged launch for


def test_nearest_bucket_is_the_closest_by_ratio_batch_first_ties_toward_the_larger(tuned_table):
    measured = [(1, 1024), (4, 1024), (4, 32768), (16, 4096), (64, 4096)]
    entries = {tuning.bucket_key(d=128, b=b, ctx=ctx, dtype=torch.float16): {"us": float(b)} for b, ctx in measured}
    others = [
        "d128_b2_ctx1024_dtypebfloat16",
        "d64_b2_ctx1024_dtypefloat16",  # other exact fields
        "d128_b2_dtypefloat16",
        "d128_bx_ctx1024_dtypefloat16",
    ]  # other layouts
    tuned_table({"op": {**entries, **{key: {"us": 0.5} for key in others}}})

    def nearest(batch, ctx, dtype=torch.float16, device="cuda"):
        return tuning.nearest_key("op", device, ("b", "ctx"), d=128, b=batch, ctx=ctx, dtype=dtype)

    assert nearest(4, 32768) == "d128_b4_ctx32768_dtypefloat16"  # measured: its own
    assert nearest(2, 1024) == "d128_b4_ctx1024_dtypefloat16"  # 1 and 4 tie (x2): the larger; not another dtype's
    assert nearest(4, 131072) == "d128_b4_ctx32768_dtypefloat16"  # beyond the longest context measured
    assert nearest(4, 4096) == "d128_b4_ctx1024_dtypefloat16"  # the batch decides first (b16 has ctx4096)
    assert nearest(32, 4096) == nearest(256, 8192) == "d128_b64_ctx4096_dtypefloat16"
    assert nearest(2, 1024, torch.bfloat16) == "d128_b2_ctx1024_dtypebfloat16"
    assert nearest(2, 1024, torch.float32) is None and nearest(2, 1024, device="cpu") is None
    assert tuning.lookup_nearest("op", "cuda", ("b", "ctx"), d=128, b=8, ctx=8192, dtype=torch.float16) == {"us": 16.0}


def test_unmeasured_buckets_take_the_nearest_entry_in_every_op(tuned_table, monkeypatch):
    monkeypatch.setattr(paged_module, "num_sms", lambda device: 132)  # the "cuda" of a CPU machine
    paged = dict(block_n=128, num_warps=8, num_stages=2, num_splits=4, us=20.0)
    flash = dict(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True, us=80.0, sdpa_us=100.0)
    gemv = W4A16Config("gemv", 1, 512, 128, split_k=8, num_warps=2, num_stages=1)
    gemm = W4A16Config("gemm", 16, 128, 64, split_k=4, num_warps=4, num_stages=4)
    tuned_table(
        {
            "paged_attention": {paged_module.table_key(128, 4, 8, 4096, torch.bfloat16): paged},
            "flash_attention": {flash_module.table_key(128, 4, 2048, torch.float16): flash},
            "w4a16": {
                w4a16_key(1, 4096, 4096, torch.float16, 128): {**gemv.entry(), "us": 3.0},
                w4a16_key(16, 4096, 4096, torch.float16, 128): {**gemm.entry(), "us": 7.0},
            },
        }
    )
    for batch, max_len in ((24, 131072), (1, 256), (256, 4096)):
        plan = paged_module.plan_launch(batch, 8, 4, 1, max_len, 128, torch.bfloat16, "cuda")
        assert plan == PagedConfig(16, 128, 8, 2, num_splits=4)
    assert flash_module.pick_config(128, torch.float16, 9000, 4, "cuda") == FlashConfig(64, 128, 4, 3, tma=True)
    assert not flash_module.sdpa_preferred(128, 4, 16384, torch.float16, "cuda")  # the s2048 measurement
    picks = [pick_w4a16_config(m, 4096, 4096, torch.float16, 128, "cuda") for m in (2, 32, 4, 3, 200)]
    # M 2: bucket 2, next to 1; 32: next to 16; 4 (and 3): 4x from both; 200: 16x from 16 — the heuristics
    assert picks == [gemv, gemm] + [heuristic_config(m, 4096, 4096, torch.float16, 128) for m in (4, 3, 200)]
    assert pick_w4a16_config(2, 4096, 4096, torch.bfloat16, 128, "cuda") == heuristic_config(
        2, 4096, 4096, torch.bfloat16, 128
    )  # no entry of its dtype


def test_every_captured_decode_launch_reads_a_paged_entry(tuned_table, monkeypatch):
    """With the buckets the paged sweep writes, every launch a captured decode step can make — any batch up to
    the ladder's largest, sized for any ``max_model_len`` — runs a table entry's configuration, not the
    heuristics: the nearest measured bucket (its own batch; the swept context nearest its own, the longest past
    them)."""
    monkeypatch.setattr(paged_module, "num_sms", lambda device: 132)
    assert paged_sweep.BATCHES == DEFAULT_LADDER and set(DEFAULT_LADDER) <= set(paged_module.BATCH_BUCKETS)
    shape = ModelShapes.named("llama-3.1-8b")
    group = shape.num_heads // shape.num_kv_heads
    tiles = [
        (c.block_n, c.num_warps, c.num_stages)
        for c in paged_module.candidate_paged_configs(shape.head_dim, torch.float16, group)
    ]
    buckets = list(itertools.product(paged_sweep.DTYPES, paged_sweep.BATCHES, paged_sweep.CONTEXTS))
    entries = {
        paged_module.table_key(shape.head_dim, group, batch, ctx, dtype): dict(
            zip(("block_n", "num_warps", "num_stages"), tiles[i % len(tiles)]), num_splits=100 + i, us=1.0
        )
        for i, (dtype, batch, ctx) in enumerate(buckets)
    }
    assert len(entries) == len(buckets)  # one key per measured bucket: no two ladder sizes share one
    tuned_table({"paged_attention": entries})
    for dtype, batch, max_len in itertools.product(
        paged_sweep.DTYPES, range(1, DEFAULT_LADDER[-1] + 1), MAX_MODEL_LENS
    ):
        plan = paged_module.plan_launch(batch, shape.num_kv_heads, group, 1, max_len, shape.head_dim, dtype, "cuda")
        entry = entries[paged_module.table_key(shape.head_dim, group, batch, _measured_context(max_len), dtype)]
        assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits) == (
            entry["block_n"],
            entry["num_warps"],
            entry["num_stages"],
            entry["num_splits"],
        ), (dtype, batch, max_len)


def _measured_context(max_len: int) -> int:
    """The swept context nearest (by ratio, ties to the larger) to a launch's context bucket."""
    bucket = paged_module.bucket_fields(128, 4, 1, max_len, torch.float16)["ctx"]
    return min(paged_sweep.CONTEXTS, key=lambda c: (max(c, bucket) / min(c, bucket), -c))


def test_every_long_prefill_and_int4_product_reads_an_entry(tuned_table):
    """The same for the flash and int4 tables with the buckets their sweeps write: every tuned prefill length
    (and past the longest) and every M a step can multiply (any batch of the ladder, prefill chunks, past the
    largest bucket) resolve to a table entry."""
    shape = ModelShapes.named("llama-3.1-8b")
    group = shape.num_heads // shape.num_kv_heads
    flash_entries = {
        flash_module.table_key(shape.head_dim, group, seq, dtype): dict(
            block_m=64, block_n=32, num_warps=4, num_stages=10 + i, tma=False, us=1.0
        )
        for i, (dtype, seq) in enumerate(itertools.product(flash_sweep.DTYPES, flash_module.SEQ_BUCKETS))
    }
    int4_entries = {}
    for n, k in w4a16_sweep.linear_shapes([shape]):
        for dtype, group_size, m in itertools.product(w4a16_sweep.DTYPES, w4a16_sweep.GROUP_SIZES, M_BUCKETS):
            heuristic = heuristic_config(m, n, k, dtype, group_size)
            tuned = next(c for c in candidate_configs(m, n, k, dtype, group_size) if c != heuristic)
            int4_entries[w4a16_key(m, n, k, dtype, group_size)] = {**tuned.entry(), "us": 1.0}
    tuned_table({"flash_attention": flash_entries, "w4a16": int4_entries})
    for dtype, seq in itertools.product(flash_sweep.DTYPES, (128, 500, 512, 3000, 16384, 20000, 131072)):
        entry = flash_entries[flash_module.table_key(shape.head_dim, group, seq, dtype)]
        assert flash_module.pick_config(shape.head_dim, dtype, seq, group, "cuda") == FlashConfig(
            64, 32, 4, entry["num_stages"]
        )
    for (n, k), dtype, m in itertools.product(
        w4a16_sweep.linear_shapes([shape]), w4a16_sweep.DTYPES, [*range(1, DEFAULT_LADDER[-1] + 1), 1000, 4096, 131072]
    ):
        entry = int4_entries[w4a16_key(m, n, k, dtype, 128)]
        assert pick_w4a16_config(m, n, k, dtype, 128, "cuda") == fit_config(W4A16Config.from_entry(entry), m, n, k, 128)
