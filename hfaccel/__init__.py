"""hfaccel: make a Hugging Face Transformers model fast on a CUDA GPU with one line.

    model = hfaccel.accelerate(model)   # same generate() call, same tokens, faster
"""

from hfaccel.compat import check_transformers_version

check_transformers_version()

from hfaccel.accelerate import Acceleration, accelerate, restore  # noqa: E402
from hfaccel.block_manager import BlockManager, CacheFullError  # noqa: E402
from hfaccel.cache import PagedCache  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Acceleration", "BlockManager", "CacheFullError", "PagedCache", "accelerate", "restore", "__version__"]
