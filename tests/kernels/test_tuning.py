"""Per-GPU tuned tables: read once, looked up by bucket; a missing or corrupt table means heuristics + a warning."""

import json

import pytest

from hfaccel.kernels import tuning


def test_table_path_is_the_gpu_name_as_a_file_name():
    assert tuning.table_path("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"
    assert tuning.bucket_key(m=16, n=4096, dtype="torch.bfloat16") == "m16_n4096_dtypebfloat16"


def test_lookup_reads_the_table_once(gpu_table):
    gpu_table.write_text(json.dumps({"gpu": "NVIDIA Test GPU 80GB", "ops": {"w4a16": {"m1_n7": {"block_n": 64, "us": 3.5}}}}))
    assert tuning.lookup("w4a16", "m1_n7", "cuda") == {"block_n": 64, "us": 3.5}
    assert tuning.lookup("w4a16", "m2_n7", "cuda") is None and tuning.lookup("paged", "m1_n7", "cuda") is None
    gpu_table.unlink()
    assert tuning.lookup("w4a16", "m1_n7", "cuda") == {"block_n": 64, "us": 3.5}  # cached per process


@pytest.mark.parametrize("content, message", [(None, "no tuned kernel table"), ("{not json", "unreadable"),
                                              ('{"ops": [1, 2]}', "unreadable"), ('{"gpu": "x"}', "unreadable"),
                                              ('{"ops": {"w4a16": [1]}}', "unreadable")])
def test_missing_or_corrupt_table_warns_and_falls_back(gpu_table, content, message):
    if content is not None:
        gpu_table.write_text(content)
    with pytest.warns(UserWarning, match=message):
        assert tuning.lookup("w4a16", "m1_n7", "cuda") is None


def test_no_table_off_cuda():
    assert tuning.gpu_name("cpu") is None and tuning.lookup("w4a16", "m1_n7", "cpu") is None
