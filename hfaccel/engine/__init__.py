"""hfaccel's serving side: the continuous-batching ``Engine`` and the packed ``ModelRunner`` under it."""

from hfaccel.engine.engine import Engine
from hfaccel.engine.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprob
from hfaccel.engine.runner import ModelRunner, SequenceKVCache, hfaccel_attention

__all__ = ["CompletionOutput", "Engine", "ModelRunner", "RequestMetrics", "RequestOutput", "SamplingParams",
           "SequenceKVCache", "TokenLogprob", "hfaccel_attention"]
