"""hfaccel: make a Hugging Face Transformers model fast on a CUDA GPU with one line.

    model = hfaccel.accelerate(model)   # same generate() call, same tokens, faster
"""

from hfaccel.compat import check_transformers_version

check_transformers_version()

from hfaccel.accelerate import Acceleration, accelerate, restore  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Acceleration", "accelerate", "restore", "__version__"]
