"""Test setup: Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is imported.
"""

import os

if os.environ.get("HFACCEL_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per worker: two workers on two cores, no oversubscription


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Start the long tests first so that parallel workers finish together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_report_header(config):
    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return (f"hfaccel tests: torch {torch.__version__}, transformers {transformers.__version__}, "
            f"triton {triton.__version__}, device {device}")
