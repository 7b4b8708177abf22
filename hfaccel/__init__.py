"""hfaccel: make a Hugging Face Transformers model fast on a CUDA GPU with one line.

    model = hfaccel.accelerate(model)   # same generate() call, same tokens, faster

``import hfaccel`` loads what ``accelerate`` needs; the engine, speculative decoding and the pipeline load on
first use of their names (``hfaccel.Engine``, ...), and the server and the tools never unless asked for.
"""

from hfaccel.compat import check_transformers_version

check_transformers_version()

from hfaccel.hf.accelerate import Acceleration, accelerate, restore  # noqa: E402
from hfaccel.kv import BlockManager, CacheFullError, PagedCache  # noqa: E402
from hfaccel.quant import Int4Linear, load_quantized, quantize, save_quantized  # noqa: E402
from hfaccel.sampling import SamplingParams, StructuredOutputs  # noqa: E402

__version__ = "0.1.0"

# public names loaded on first use: name -> module
_LAZY = {
    "Engine": "hfaccel.engine",
    "AsyncEngine": "hfaccel.engine",
    "RequestOutput": "hfaccel.engine",
    "pipeline": "hfaccel.hf.pipeline",
    "speculative_generate": "hfaccel.speculative",
    "SpeculativeStats": "hfaccel.speculative",
    "structured_logits_processor": "hfaccel.hf.structured",
}

__all__ = [
    "Acceleration",
    "AsyncEngine",
    "BlockManager",
    "CacheFullError",
    "Engine",
    "Int4Linear",
    "PagedCache",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeStats",
    "StructuredOutputs",
    "__version__",
    "accelerate",
    "load_quantized",
    "pipeline",
    "quantize",
    "restore",
    "save_quantized",
    "speculative_generate",
    "structured_logits_processor",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfaccel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
