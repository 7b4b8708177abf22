"""hfaccel's kernel layer: Triton kernels with typed launchers and pure-torch references.

Imported as ``hfaccel.kernels``. Depends on torch and triton only (nothing from transformers or hfaccel).
Each public op picks its path per call: CUDA tensors run the Triton kernel; CPU tensors run the same
kernel through Triton's interpreter when ``TRITON_INTERPRET=1``; otherwise the pure-torch reference.
"""

from hfaccel.kernels.flash_attention import flash_attention, flash_attention_reference
from hfaccel.kernels.runtime import Backend, resolve_backend, triton_can_run

__all__ = [
    "Backend",
    "flash_attention",
    "flash_attention_reference",
    "resolve_backend",
    "triton_can_run",
]
