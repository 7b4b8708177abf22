"""The rank's view of a model transformers sharded with ``tp_plan`` (``from_pretrained(path, tp_plan="auto")`` under
``torchrun``): each rank holds ``num_attention_heads / tp`` query heads and ``num_key_value_heads / tp`` KV heads,
and transformers' own hooks all-reduce after ``o_proj`` and ``down_proj`` and gather the logits, so every rank ends
a forward with the same full logits. hfaccel's attention runs on the local heads unchanged; its KV pool holds the
local KV heads (:func:`hfaccel.kv.local_kv_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from hfaccel import compat
from hfaccel.device import model_device
from hfaccel.kv import local_kv_heads

SUPPORTED = (
    "hfaccel serves a model on one device, or sharded by transformers' tensor parallelism "
    '(from_pretrained(path, tp_plan="auto") under torchrun: one device per rank)'
)


_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype)  # what broadcast_tree sends as it is


class _Shape(NamedTuple):
    """A tensor's place in a :meth:`TensorParallel.broadcast_tree` layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel ranks a model is sharded over."""

    group: dist.ProcessGroup
    size: int  # ranks in the group
    rank: int  # this process's rank in the group
    leader: int  # global rank of the group's rank 0: it schedules, samples and broadcasts
    device: torch.device  # the rank's device: where its collectives' tensors live (CUDA for NCCL)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the leader holds it, on every rank (in place; returned for chaining)."""
        dist.broadcast(tensor, src=self.leader, group=self.group)
        return tensor

    def broadcast_tree(self, tree=None):
        """``tree`` (nested dicts, lists, tuples and model outputs of tensors and plain values) as the leader holds
        it, on every rank (followers pass nothing), its tensors on the rank's device: its layout, each tensor stood
        in for by its shape and dtype, in one object broadcast, then each tensor broadcast. A leaf of another kind
        (whose tensors would travel pickled, on the leader's device) is a ``TypeError`` before anything is sent."""
        leaves, spec = pytree.tree_flatten(tree) if self.is_leader else ([], None)
        odd = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, (torch.Tensor, *_PLAIN))]
        if odd:
            raise TypeError(f"broadcast_tree takes tensors and plain values in dicts, lists and tuples; got {odd[0]}")
        layout = [(spec, [_Shape(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves])]
        dist.broadcast_object_list(layout, src=self.leader, group=self.group, device=self.device)
        spec, shapes = layout[0]
        if not self.is_leader:
            leaves = [
                torch.empty(s.shape, dtype=s.dtype, device=self.device) if isinstance(s, _Shape) else s for s in shapes
            ]
        for i, shape in enumerate(shapes):
            if isinstance(shape, _Shape):
                leaves[i] = self.broadcast(leaves[i].to(self.device).contiguous())
        return pytree.tree_unflatten(leaves, spec)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (every rank calls it)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


def tensor_parallel(model) -> TensorParallel | None:
    """The TP ranks of a model transformers sharded with ``tp_plan``, or None for a model on one process."""
    group = compat.tp_group(model)
    if group is None:
        return None
    return TensorParallel(
        group, dist.get_world_size(group), dist.get_rank(group), dist.get_global_rank(group, 0), model_device(model)
    )


def shards_beyond_language_model(model) -> bool:
    """Whether transformers' TP plan shards modules of ``model`` besides its language model and output projection
    (Gemma 4's and Llama 4's vision towers): what runs those must run on every rank together, as a forward does."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = next((name for name, module in model.named_modules() if module is decoder), "")
    if not prefix:  # the model is its language model
        return False
    return any(not (key.startswith(f"{prefix}.") or key.startswith("lm_head")) for key in compat.tp_plan(model))


def _checkpoint_fp8_layer(model) -> str | None:
    """The name of a layer holding fp8 weights as a checkpoint loaded them (transformers' or compressed-tensors'
    layers), or None; hfaccel's own per-rank fp8 shards (``quantize="fp8"``) do not count."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.dtype == torch.float8_e4m3fn
            and not type(module).__module__.startswith("hfaccel.")
        ):
            return name
    return None


def check_sharding(model, what: str = "hfaccel.accelerate", *, quantize: str | None = None) -> None:
    """Raise a ``ValueError`` that says what is supported when ``model`` is sharded in a way hfaccel cannot serve:
    spread over several devices by ``device_map``, split by a TP size that does not divide its KV heads, or
    quantized under tensor parallelism by a method other than RTN or fp8 (``quantize``: the method asked for; each
    rank quantizes its shard, :func:`hfaccel.distributed.quant.quantize_shards`)."""
    devices = compat.device_map_devices(model)
    if len(devices) > 1:
        raise ValueError(
            f"{what}: {SUPPORTED}; this model is split across devices {sorted(devices)} by "
            f'device_map. Load it on one device, or with tp_plan="auto" under torchrun'
        )
    if compat.tp_size(model) > 1:
        local_kv_heads(model)  # raises when the TP size does not divide the KV heads
    if compat.tp_size(model) > 1 and _checkpoint_fp8_layer(model) is not None:
        raise ValueError(
            f"{what}: an fp8 checkpoint's layers under tensor parallelism (e.g. "
            f"{_checkpoint_fp8_layer(model)}) are not served, as int4 checkpoints are not; load the "
            '16-bit model with tp_plan="auto" and pass quantize="fp8": each rank quantizes its '
            "shard"
        )
    if compat.tp_size(model) > 1 and quantize not in (None, "rtn", "fp8"):
        raise ValueError(
            f"{what}: int4 under tensor parallelism quantizes each rank's shard with RTN "
            f'(quantize="rtn"; fp8 too: quantize="fp8"); quantize={quantize!r} calibrates on one '
            "process"
        )
