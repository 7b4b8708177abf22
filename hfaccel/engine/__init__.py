"""hfaccel's serving side: packed forwards over a paged KV pool (``runner``)."""

from hfaccel.engine.runner import ModelRunner, SequenceKVCache, hfaccel_attention

__all__ = ["ModelRunner", "SequenceKVCache", "hfaccel_attention"]
