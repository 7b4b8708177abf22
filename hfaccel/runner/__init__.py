"""Packed forwards of a Hugging Face model over a KV pool, with a static-shape (CUDA-graph) decode mode."""

from hfaccel.runner.graphs import DecodeGraphs, compiles
from hfaccel.runner.runner import ModelRunner

__all__ = ["DecodeGraphs", "ModelRunner", "compiles"]
