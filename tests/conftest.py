"""Test setup: Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is imported.
"""

import os

if os.environ.get("HFACCEL_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from tests.interpreter import (  # noqa: E402
        patch_language_once_per_launch,
        reuse_interpreted_types,
        skip_discarded_overflow_checks,
    )

    patch_language_once_per_launch()
    skip_discarded_overflow_checks()
    reuse_interpreted_types()

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per worker: two workers on two cores, no oversubscription


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def recompile_limit_per_model():
    """transformers compiles every model's ``__call__`` (one code object) for its static-cache path, so the models of
    a process share dynamo's recompile limit (8 graphs): give a test among a worker's many models the room one model
    has in a user's process."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def pytest_collection_modifyitems(config, items):
    """Keep this run's part of the suite (``HFACCEL_TEST_PART=k/n``: whole test files, balanced by their number of
    tests), then start the long tests first so that parallel workers finish together."""
    part = os.environ.get("HFACCEL_TEST_PART")
    if part:
        files = _files_of_part(items, *_parse_part(part))
        kept = [item for item in items if item.path in files]
        config.hook.pytest_deselected(items=[item for item in items if item.path not in files])
        items[:] = kept
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _parse_part(part: str) -> tuple[int, int]:
    try:
        index, count = (int(n) for n in part.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"HFACCEL_TEST_PART must be k/n with 1 <= k <= n (e.g. 1/3); got {part!r}")
    return index, count


def _files_of_part(items, index: int, count: int) -> set:
    """The test files of part ``index`` of ``count``: files by falling number of tests, each to the lightest part
    so far (ties by path, so every part sees the same split)."""
    sizes: dict = {}
    for item in items:
        sizes[item.path] = sizes.get(item.path, 0) + 1
    loads, parts = [0] * count, [set() for _ in range(count)]
    for path, size in sorted(sizes.items(), key=lambda entry: (-entry[1], str(entry[0]))):
        lightest = loads.index(min(loads))
        loads[lightest] += size
        parts[lightest].add(path)
    return parts[index - 1]


def pytest_report_header(config):
    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return (
        f"hfaccel tests: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"triton {triton.__version__}, device {device}"
    )


@pytest.fixture
def tuned_table(monkeypatch, tmp_path):
    """Make every CUDA device look like one GPU with a tuned table: ``tuned_table(ops)`` writes the table's ``ops``
    (op -> bucket key -> entry) and returns its path. Off CUDA devices ("cpu") still have no table."""
    from hfaccel.kernels import tuning

    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(
        tuning,
        "gpu_name",
        lambda device=None: "NVIDIA Test GPU 80GB" if torch.device(device or "cuda").type == "cuda" else None,
    )
    tuning.load_table.cache_clear()

    def write(ops: dict):
        path = tmp_path / "nvidia-test-gpu-80gb.json"
        path.write_text(json.dumps({"gpu": "NVIDIA Test GPU 80GB", "ops": ops}))
        tuning.load_table.cache_clear()
        return path

    yield write
    tuning.load_table.cache_clear()
