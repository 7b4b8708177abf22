"""``LoRALinear``: a model's Linear layer (``nn.Linear`` or hfaccel's ``Int4Linear``) plus a pool of LoRA slots,
each token taking the adapter of its own slot.

Every wrapped layer of a model shares one :class:`LoRAContext`, which the runner sets for each forward: the slot of
each packed token (``index [T]``, -1 for the base model) — or None, and then the layer is exactly its base layer
(no LoRA op runs: a batch without adapters pays nothing). With an index the layer adds, per token,
``x @ A[slot].T @ B[slot].T`` through the batched kernels (``torch.ops.hfaccel.lora``: one fused launch per layer
in a decode step; opaque to ``torch.compile`` and capturable in a CUDA graph). The pools are filled in place
(``load_slot``), so a compiled or captured step keeps reading the right memory whichever adapters come and go.
"""

from __future__ import annotations

import torch
from torch import nn

from hfaccel.kernels.ops import lora_op
from hfaccel.quant.linear import Int4Linear

LINEAR_TYPES = (nn.Linear, Int4Linear)


class LoRAContext:
    """What one forward tells every wrapped layer of a model (set by the runner, read by :class:`LoRALinear`).

    ``index``: ``[T]`` int64 slot of each packed token on the model's device (-1: no adapter), or None (no token
    takes one); ``rows``: while a module runs on other rows than the packed ones (a hybrid model's recurrent mixer,
    run per group of sequences by ``hfaccel.kv.state``), the packed token of each of its rows (``[R]`` int64; None:
    the packed rows themselves); ``slots``: the slots present, a host list the torch reference loops over (ignored
    by the kernels, and by compiled or captured steps, which must serve any mix); ``backend``: the kernels' backend
    (``auto``, ``triton``, ``torch``: the model's attention backend). ``detached``: another engine took these
    layers' places.
    """

    def __init__(self, backend: str = "auto"):
        self.index: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.slots: list[int] | None = None
        self.backend = backend
        self.detached = False


class LoRALinear(nn.Module):
    """``base_layer(x) + (x @ a[s].T) @ b[s].T`` for each token's slot ``s`` (none: the base output, untouched).

    Buffers: ``lora_a [S, R, K]`` and ``lora_b [S, N, R]`` in the layer's dtype on its device, ``S = max_loras``
    slots of rank ``R = max_lora_rank`` (an adapter's own rank zero-padded; ``b`` holds the LoRA scaling).
    """

    def __init__(self, base_layer: nn.Module, context: LoRAContext, *, max_loras: int, max_rank: int):
        super().__init__()
        if not isinstance(base_layer, LINEAR_TYPES):
            raise TypeError(f"LoRALinear wraps nn.Linear or Int4Linear; got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.context = context
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        dtype, device = layer_dtype(base_layer), layer_device(base_layer)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=device), persistent=False
        )

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, for model code that reads it rather than calling the layer (Jamba's ``dt_proj``):
        without the adapters, as under PEFT's layers."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias (as :attr:`weight`)."""
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]; the runner's packed row is [1, T, K], one index per token
        y = self.base_layer(x)
        index = self.context.index
        if index is None:
            return y
        if self.context.rows is not None:  # a mixer's rows: each one's packed token's slot
            index = index.index_select(0, self.context.rows)
        flat = x.reshape(-1, self.in_features)  # [T, K]
        if flat.shape[0] != index.shape[0]:
            raise RuntimeError(
                f"LoRALinear got {flat.shape[0]} rows for {index.shape[0]} token slots: a LoRA "
                "target must see every packed token once (not lm_head, not routed experts)"
            )
        slots = self._slots()
        backend = self.context.backend
        out = lora_op(flat, y.reshape(-1, self.out_features), self.lora_a, self.lora_b, index, slots, backend)  # [T, N]
        return out.reshape(y.shape)

    def _slots(self) -> list[int] | None:
        """The host hint of the slots present, where the call runs once as it is (not traced, not captured)."""
        if torch.compiler.is_compiling():
            return None
        if self.lora_a.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return self.context.slots

    @torch.no_grad()
    def load_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put ``(A [r, K], B [N, r])`` (B already scaled) into ``slot``, zero-padded to the pool's rank; None zeroes
        the slot (an adapter that leaves this layer alone). In place: captured graphs stay valid."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is None:
            return
        a, b = weights
        rank = a.shape[0]
        self.lora_a[slot, :rank].copy_(a, non_blocking=True)
        self.lora_b[slot, :, :rank].copy_(b, non_blocking=True)

    def extra_repr(self) -> str:
        slots, rank = self.lora_a.shape[0], self.lora_a.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, lora_slots={slots}, max_rank={rank}"


def layer_dtype(layer: nn.Module) -> torch.dtype:
    """The activation dtype of a Linear or Int4Linear layer."""
    return layer.scales.dtype if isinstance(layer, Int4Linear) else layer.weight.dtype


def layer_device(layer: nn.Module) -> torch.device:
    return layer.qweight.device if isinstance(layer, Int4Linear) else layer.weight.device
