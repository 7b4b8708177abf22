"""Serving LoRA adapters over one base model: PEFT adapter directories read and checked (``adapter``), the model's
Linear layers wrapped with a pool of adapter slots that each token indexes (``layer``), and the registry and slot
manager an engine drives (``manager``)."""

from hfaccel.lora.adapter import LoRAAdapter, load_adapter, read_peft_adapter
from hfaccel.lora.layer import LoRAContext, LoRALinear
from hfaccel.lora.manager import DEFAULT_TARGET_MODULES, LoRAManager, linear_layers

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LoRAAdapter",
    "LoRAContext",
    "LoRALinear",
    "LoRAManager",
    "linear_layers",
    "load_adapter",
    "read_peft_adapter",
]
