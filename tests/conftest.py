"""Test setup: Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return (f"hfaccel tests: torch {torch.__version__}, transformers {transformers.__version__}, "
            f"triton {triton.__version__}, device {device}")
