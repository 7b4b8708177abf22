"""An fp8 KV pool: the ``kv_cache_dtype`` settings, and the pool's scales — one per layer, K and V, and KV head
(``pool = fp8(x / scale)``, read as ``pool * scale``).

Where the scales come from (``kv_scales=`` of ``KVPool``, ``PagedCache``, ``Engine`` and ``accelerate``):

- ``None``: the checkpoint's — the ``k_scale`` / ``v_scale`` an attention module carries (a compressed-tensors
  ``kv_cache_scheme``, read by ``hfaccel.load_quantized`` or by transformers) — else 1.0 (values beyond ±448
  saturate; vLLM's default too);
- a number: that scale everywhere;
- ``"prefill"``: each layer's first prefill sets its heads' scales to ``HEADROOM x amax(|x|) / 448`` of the keys and
  values it stores, then they stay (blocks written earlier must keep reading back right).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from hfaccel.kernels.fp8 import fp8_kernels_run
from hfaccel.kernels.write_kv import FP8_MAX

HEADROOM = 2.0  # "prefill" scales leave room for values twice the first prefill's largest before saturating
KV_SCALE_SOURCES = ("prefill",)

KVScales = float | str | Mapping[int, torch.Tensor] | None  # None, a number, "prefill", or {layer: [2, Hkv]}
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(value: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The dtype a pool stores K/V in (None: the model's) for a ``kv_cache_dtype`` setting; a ValueError for a value
    not among :data:`KV_CACHE_DTYPES`, or fp8 on a GPU whose kernels cannot read it (before sm_89)."""
    if value is None:
        return None
    dtype = KV_CACHE_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in (None, torch.float8_e4m3fn):
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)} or torch.float8_e4m3fn; got {value!r}"
        )
    if dtype is not None and device.type == "cuda" and not fp8_kernels_run(device):
        raise ValueError(
            f"kv_cache_dtype={value!r}: this GPU ({torch.cuda.get_device_name(device)}) cannot convert "
            "fp8 (sm_89 or later: Ada, Hopper, Blackwell); use kv_cache_dtype='auto'"
        )
    return dtype


def check_kv_scales(kv_scales: KVScales) -> KVScales:
    """``kv_scales`` as given, or a ValueError that says what is taken."""
    if kv_scales is None or kv_scales in KV_SCALE_SOURCES:
        return kv_scales
    if isinstance(kv_scales, Mapping):
        return kv_scales
    if (
        isinstance(kv_scales, (int, float))
        and not isinstance(kv_scales, bool)
        and math.isfinite(kv_scales)
        and kv_scales > 0
    ):
        return float(kv_scales)
    raise ValueError(
        f"kv_scales must be None (the checkpoint's, else 1.0), a positive number, 'prefill' (from each "
        f"layer's first prefill) or {{layer: tensor [2, kv_heads]}}; got {kv_scales!r}"
    )


def model_kv_scales(model) -> dict[int, torch.Tensor]:
    """``{layer: [2, Hkv or 1] fp32}`` of the attention modules of ``model`` that carry ``k_scale`` and ``v_scale``
    (a checkpoint's fp8 KV scales, per tensor or per KV head); empty when none does."""
    scales = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
        if isinstance(layer, int) and isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor):
            scales[layer] = torch.stack([k_scale.detach().float().reshape(-1), v_scale.detach().float().reshape(-1)])
    return scales


def fill_scales(scales: torch.Tensor, layer: int, given: torch.Tensor) -> None:
    """Write one layer's ``given [2, Hkv or 1]`` into its row of a pool's ``scales [L_g, 2, Hkv]``."""
    heads = scales.shape[-1]
    given = torch.as_tensor(given, dtype=torch.float32).reshape(2, -1)
    if given.shape[1] not in (1, heads):
        raise ValueError(
            f"layer {layer}'s KV scales have {given.shape[1]} per K/V; the pool holds {heads} KV heads "
            f"(expected 1 or {heads})"
        )
    if not bool((given > 0).all()) or not bool(given.isfinite().all()):
        raise ValueError(f"layer {layer}'s KV scales must be finite and > 0; got {given.tolist()}")
    scales[layer].copy_(given.to(scales.device).expand(2, heads))


def prefill_scales(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """``[2, Hkv]`` fp32 scales of the tokens of ``keys, values [B, S, Hkv, D]`` stored (``slots [B, S] >= 0``):
    ``HEADROOM x amax / 448`` per head (1.0 for a head of zeros); None when no token is stored."""
    stored = (slots >= 0).reshape(-1)  # [B*S]
    if not bool(stored.any()):
        return None
    both = torch.stack([keys, values]).flatten(1, 2)[:, stored]  # [2, N, Hkv, D]
    amax = both.abs().float().amax(dim=(1, 3))  # [2, Hkv]
    return torch.where(amax > 0, amax * (HEADROOM / FP8_MAX), torch.ones_like(amax))
