"""hfaccel inside transformers' own API: ``accelerate`` / ``restore``, ``generate`` and ``pipeline``."""

from hfaccel.hf.accelerate import Acceleration, accelerate, restore

__all__ = ["Acceleration", "accelerate", "restore"]
