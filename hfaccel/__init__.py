"""hfaccel: make a Hugging Face Transformers model fast on a CUDA GPU with one line.

    model = hfaccel.accelerate(model)   # same generate() call, same tokens, faster
"""

from hfaccel.compat import check_transformers_version

check_transformers_version()

from hfaccel.accelerate import Acceleration, accelerate, restore  # noqa: E402
from hfaccel.block_manager import BlockManager, CacheFullError  # noqa: E402
from hfaccel.cache import PagedCache  # noqa: E402
from hfaccel.quant import Int4Linear, load_quantized, quantize, save_quantized  # noqa: E402
from hfaccel.speculative import SpeculativeStats, speculative_generate  # noqa: E402
from hfaccel.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from hfaccel.engine.async_engine import AsyncEngine  # noqa: E402
from hfaccel.pipeline import pipeline  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Acceleration", "AsyncEngine", "Engine", "RequestOutput", "SamplingParams", "pipeline", "BlockManager", "CacheFullError", "Int4Linear", "PagedCache", "accelerate",
           "load_quantized", "quantize", "restore", "save_quantized", "SpeculativeStats",
           "speculative_generate", "__version__"]
