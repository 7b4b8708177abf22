"""Multi-head latent attention (MLA) read in the latent space, its expansion absorbed into the query and the output.

transformers' MLA modules (DeepSeek-V2/V3 and their kin) cache two latents a token, ``c`` (``kv_lora_rank`` wide) and
the rotary key ``r``, and expand them after reading the cache (``expand_kv``): head ``h``'s key is
``[c W_UK[h]^T | r]`` and its value ``c W_UV[h]^T``, ``W_UK`` and ``W_UV`` being rows of ``kv_b_proj``. So a score
``q . k = [q_nope W_UK[h] | q_rope] . [c | r]`` and an output ``sum p v = (sum p c) W_UV[h]^T``: attention can run
over the latents themselves, one KV head ``[c | r]`` read as both keys and values, with the query
``[q_nope W_UK | q_rope]`` and the first ``kv_lora_rank`` columns of the output times ``W_UV`` (vLLM's MLA decode).
It reads the 576 values a token DeepSeek caches, in place, where the expansion writes ``heads * (qk + v)`` values
for every held token at every step.

The pool keeps a latent layer's key and value rows of a token one after the other (``KVPool``), so that ``[c | r]``
is one row the paged kernel reads (``paged_attention_op(joined=True)``). The runner's cache hands an absorbed layer
a ``PagedKV`` whose ``latent`` is set (``hfaccel.kv.hf_cache``), except on the forward of one prompt's whole
prefill, where expanding its new tokens is transformers' own and cheaper path; the module's ``expand_kv`` passes it
through (:func:`install_absorption`) and hfaccel's attention does the rest (``hfaccel.attention.functions``).
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from hfaccel import compat
from hfaccel.kv.layout import ModelLayout

# attention module -> the runners reading it in the latent space (its pass-through stays while one does)
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# a quantized kv_b_proj -> (device, dtype, width, its tensors' state), the matrix it multiplies by dequantized (_matrix)
_DEQUANTIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LatentHeads:
    """How an absorbed layer's module expands its latents: ``heads`` query heads, each with a key ``nope`` wide
    before its rotary part and a value ``value`` wide, rows of ``weight [heads * (nope + value), C]``, the matrix
    ``kv_b_proj`` multiplies by (a Linear's own weight; a quantized layer's, dequantized once)."""

    heads: int
    nope: int
    value: int
    weight: torch.Tensor = field(compare=False, repr=False)

    def split_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, nope, C]`` and ``W_UV [heads, value, C]`` (views of ``weight``)."""
        per_head = self.weight.view(self.heads, self.nope + self.value, self.weight.shape[-1])
        return per_head[:, : self.nope], per_head[:, self.nope :]


def absorbed_layers(
    model: nn.Module, layout: ModelLayout, kv_cache_dtype: torch.dtype | None = None
) -> dict[int, LatentHeads]:
    """The latent layers of ``layout`` whose attention runs in the latent space: those whose module's
    ``expand_kv`` gives the keys and values the rows of the matrix ``kv_b_proj`` multiplies by give (checked on
    random latents), ``kv_b_proj`` being a layer of its own (a Linear, or a quantized one: int4, fp8) without bias —
    not an adapter wrapper, whose matrix changes with the active adapter; none over an fp8 pool
    (``kv_cache_dtype``), whose two halves of a latent row have scales of their own."""
    if kv_cache_dtype is not None:
        return {}
    modules = {
        module.layer_idx: module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and callable(getattr(module, "expand_kv", None))
    }
    found = {}
    for layer, kv in layout.attention.items():
        plain = kv.window is None and kv.chunk is None and getattr(modules.get(layer), "sinks", None) is None
        if kv.latent and layer in modules and plain:  # (the latent-space attention has no window, chunk nor sinks)
            heads = _latent_heads(modules[layer], kv.key_dim, kv.value_dim)
            if heads is not None:
                found[layer] = heads
    return found


@torch.no_grad()
def _latent_heads(module: nn.Module, latent_dim: int, rope_dim: int) -> LatentHeads | None:
    """The module's :class:`LatentHeads` where its ``expand_kv`` is ``kv_b_proj``'s split (module docstring), in the
    dtype of the module's floating-point parameters (its norms')."""
    projection = getattr(module, "kv_b_proj", None)
    reference = next((p for p in module.parameters() if p.is_floating_point()), None)
    if not isinstance(projection, nn.Module) or next(projection.children(), None) is not None or reference is None:
        return None
    device, dtype = reference.device, reference.dtype
    if device.type == "meta":
        return None
    weight = _matrix(projection, latent_dim, device, dtype)  # [heads * (nope + value), C]
    if weight is None:
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    latent = torch.randn(1, 1, 3, latent_dim, generator=generator).to(device, dtype)  # [1, 1, S, C]
    rope = torch.randn(1, 1, 3, rope_dim, generator=generator).to(device, dtype)  # [1, 1, S, R]
    keys, values = type(module).expand_kv(module, latent, rope)  # [1, H, S, nope + R], [1, H, S, value]
    heads = LatentHeads(keys.shape[1], keys.shape[-1] - rope_dim, values.shape[-1], weight)
    if weight.shape[0] != heads.heads * (heads.nope + heads.value):
        return None
    key_rows, value_rows = heads.split_weight()
    expected_keys = torch.cat([latent @ key_rows.transpose(1, 2), rope.expand(-1, heads.heads, -1, -1)], -1)
    expected_values = latent @ value_rows.transpose(1, 2)
    exact = type(projection) is nn.Linear and dtype == torch.float32  # else rounded as 16-bit (or int4) kernels do
    tolerance = 1e-5 if exact else 1e-2
    matches = all(
        _relative_error(got, want) < tolerance for got, want in ((keys, expected_keys), (values, expected_values))
    )
    return heads if matches else None


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


def _matrix(projection: nn.Module, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The matrix ``[out, width]`` a layer without bias multiplies its inputs by: a Linear's own weight, else its
    outputs for the identity (a quantized layer's weights dequantized, once per layer, device, dtype and state of its
    tensors: every runner over the model shares it); None for a layer with a bias or of other widths."""
    if type(projection) is nn.Linear:
        weight = compat.local_tensor(projection.weight)  # a tensor-parallel rank's heads
        ok = projection.bias is None and weight.is_floating_point() and weight.shape[1] == width
        return weight if ok else None
    key = (device, dtype, width, _tensors_state(projection))
    held = _DEQUANTIZED.get(projection)
    if held is not None and held[0] == key:
        return held[1]
    try:
        columns = projection(torch.eye(width, device=device, dtype=dtype))  # [width, out]: row i is column i
        at_zero = projection(torch.zeros(1, width, device=device, dtype=dtype))
    except (RuntimeError, ValueError, TypeError):  # not a layer of that width
        return None
    if columns.dim() != 2 or columns.shape[0] != width or at_zero.abs().max() != 0:
        return None
    _DEQUANTIZED[projection] = (key, columns.t().contiguous())
    return _DEQUANTIZED[projection][1]


def _tensors_state(module: nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each of a layer's tensors lives and how often it was changed in place (``load_state_dict``)."""
    return tuple((t.data_ptr(), t._version) for t in (*module.parameters(), *module.buffers()))


def install_absorption(model: nn.Module, layers: dict[int, LatentHeads], user: object) -> None:
    """Give the modules of ``layers`` an ``expand_kv`` that passes a view of the pool on (what the runner's cache
    returns for them) and expands tensors as their class does, for ``user`` (a runner: idempotent). A module keeps it
    while a user reads it in the latent space (modules may be shared between models): :func:`release_absorption`,
    :func:`remove_absorption`."""
    for module in _latent_modules(model, layers):
        _USERS.setdefault(module, weakref.WeakSet()).add(user)
        if not _installed(module):
            module.expand_kv = types.MethodType(expand_kv, module)


def release_absorption(model: nn.Module, user: object) -> None:
    """``user`` reads ``model`` in the latent space no more; a module's last user takes its pass-through away."""
    for module in model.modules():
        users = _USERS.get(module)
        if users is not None:
            users.discard(user)
    remove_absorption(model)


def remove_absorption(model: nn.Module) -> None:
    """Take away :func:`install_absorption`'s pass-through and the dequantized matrices, but from the modules a runner
    still reads in the latent space (an engine's: they go with that runner's release)."""
    for module in model.modules():
        if _installed(module) and not _USERS.get(module):
            del module.expand_kv
            if isinstance(getattr(module, "kv_b_proj", None), nn.Module):
                _DEQUANTIZED.pop(module.kv_b_proj, None)


def _latent_modules(model: nn.Module, layers: dict[int, LatentHeads]) -> list[nn.Module]:
    return [
        module
        for module in model.modules()
        if getattr(module, "layer_idx", None) in layers and callable(getattr(module, "expand_kv", None))
    ]


def expand_kv(module: nn.Module, kv_nope, k_rot):
    """:func:`install_absorption`'s ``expand_kv`` (bound to each module; named as the method it stands for, so that
    a pickled model takes its class's back): a view of the pool passed on, tensors expanded by the class's own."""
    if isinstance(kv_nope, torch.Tensor):
        return type(module).expand_kv(module, kv_nope, k_rot)
    return kv_nope, k_rot  # the pool's latent view: hfaccel's attention reads it in the latent space


def _installed(module: nn.Module) -> bool:
    return getattr(vars(module).get("expand_kv"), "__func__", None) is expand_kv
