"""The continuous-batching ``Engine`` (and ``AsyncEngine`` for services) over one Hugging Face model."""

from hfaccel.device import DeviceLostError
from hfaccel.engine.async_engine import AsyncEngine
from hfaccel.engine.engine import Engine
from hfaccel.engine.inputs import PreparedPrompt
from hfaccel.engine.outputs import CompletionOutput, RequestFailed, RequestMetrics, RequestOutput
from hfaccel.sampling import InvalidSamplingParams, SamplingParams, TokenLogprob

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "DeviceLostError",
    "Engine",
    "InvalidSamplingParams",
    "PreparedPrompt",
    "RequestFailed",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
