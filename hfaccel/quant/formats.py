"""AWQ ("gemm") and GPTQ (v1 / v2) int4 tensor layouts, and the exact repack into hfaccel's kernel layout.

Formats (``shared/notes/int4-formats.md``; ``K`` = in_features, ``N`` = out_features, ``g`` = group size,
8 nibbles per int32, lowest first):

- AWQ: ``qweight [K, N/8]`` and ``qzeros [K/g, N/8]`` packed along N in nibble order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` (column ``8c + order[j]`` in nibble j of word c); ``scales [K/g, N]``;
  ``W[n, k] = (q[k, n] - z[k//g, n]) * s[k//g, n]``.
- GPTQ: ``qweight [K/8, N]`` packed along K (row ``8r + j`` in nibble j); ``qzeros [K/g, N/8]`` packed along N
  sequentially; ``scales [K/g, N]``; ``g_idx [K]``; ``W[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``;
  v1 files store ``z - 1``, v2 files ``z``.

hfaccel's layout (``hfaccel.kernels.w4a16``) is GPTQ's qweight layout with groups made contiguous: rows are
ordered by ``g_idx`` (a permutation ``perm`` applied to the activations), zeros unpacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8c + AWQ_ORDER[j]


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` values 0..15 → ``[K/8, N]`` int32; row ``8r + j`` in nibble ``j``."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"rows must be a multiple of 8 to pack; got {k}")
    q = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)[None, :, None]
    return _to_int32((q << shifts).sum(1))


def unpack_along_rows(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)[None, :, None]
    return ((packed[:, None, :] >> shifts) & 0xF).reshape(-1, packed.shape[1])


def pack_along_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """``[R, N]`` values 0..15 → ``[R, N/8]`` int32; column ``8c + order[j]`` in nibble ``j`` of word ``c``."""
    r, n = q.shape
    if n % 8:
        raise ValueError(f"columns must be a multiple of 8 to pack; got {n}")
    q = q.to(torch.int64).reshape(r, n // 8, 8)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    return _to_int32((q << shifts).sum(-1))


def unpack_along_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, N/8, 8]: nibble j holds column order[j]
    inverse = [order.index(c) for c in range(8)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32-bit patterns → int32 with the same bits (two's complement wrap)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class Int4Weight:
    """A quantized ``[N, K]`` Linear weight in hfaccel's kernel layout (plus what is needed to write it back)."""

    qweight: torch.Tensor  # [K/8, N] int32, rows in group order
    scales: torch.Tensor  # [K/g, N]
    zeros: torch.Tensor  # [K/g, N], integer zero points in the scales' dtype
    group_size: int
    perm: torch.Tensor | None = None  # [K] int64: kernel row i is weight column perm[i]; None = identity
    g_idx: torch.Tensor | None = None  # [K] int32 group of each original column (GPTQ act-order), for saving

    @classmethod
    def from_values(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        g_idx: torch.Tensor | None = None,
    ) -> Int4Weight:
        """From integer values ``q [K, N]`` (0..15) in original column order and per-group scales/zeros;
        a ``g_idx`` other than ``arange(K) // group_size`` (activation order) is made contiguous by a ``perm``."""
        k = q.shape[0]
        default = torch.arange(k, device=q.device) // group_size
        if g_idx is None or torch.equal(g_idx.long().to(q.device), default):
            return cls(pack_along_rows(q), scales, zeros, group_size)
        counts = torch.bincount(g_idx.long(), minlength=scales.shape[0])
        if not torch.all(counts == group_size):
            raise ValueError(
                f"g_idx must put exactly group_size={group_size} columns in each group; "
                f"got group sizes {sorted(set(counts.tolist()))}"
            )
        perm = torch.argsort(g_idx.long(), stable=True)
        return cls(pack_along_rows(q[perm]), scales, zeros, group_size, perm=perm, g_idx=g_idx.to(torch.int32))

    def values(self) -> torch.Tensor:
        """The integer weight ``[K, N]`` in original column order (0..15)."""
        q = unpack_along_rows(self.qweight)
        return q if self.perm is None else q[torch.argsort(self.perm)]

    def groups(self) -> torch.Tensor:
        """Group index ``[K]`` of each original column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        k = self.qweight.shape[0] * 8
        return torch.arange(k, device=self.qweight.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 weight, as ``nn.Linear.weight`` holds it."""
        groups = self.groups()
        q = self.values().float()
        return ((q - self.zeros.float()[groups]) * self.scales.float()[groups]).t()


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """AWQ "gemm" tensors → hfaccel layout (exact)."""
    q = unpack_along_cols(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_along_cols(qzeros, AWQ_ORDER).to(scales.dtype)
    return Int4Weight(pack_along_rows(q), scales.clone(), zeros, group_size)


def to_awq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    if weight.perm is not None:
        raise ValueError("an activation-order (desc_act) weight has no AWQ representation; save as gptq")
    return {
        "qweight": pack_along_cols(weight.values(), AWQ_ORDER),
        "qzeros": pack_along_cols(weight.zeros.round().to(torch.int64), AWQ_ORDER),
        "scales": weight.scales.to(torch.float16),
    }


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    *,
    v1: bool,
) -> Int4Weight:
    """GPTQ tensors → hfaccel layout (exact); ``v1`` files store zero points minus one."""
    zeros = unpack_along_cols(qzeros)
    if v1:
        zeros = (zeros + 1) & 0xF
    return Int4Weight.from_values(unpack_along_rows(qweight), scales.clone(), zeros.to(scales.dtype), group_size, g_idx)


def to_gptq(weight: Int4Weight, *, v1: bool) -> dict[str, torch.Tensor]:
    zeros = weight.zeros.round().to(torch.int64)
    if v1:
        zeros = (zeros - 1) & 0xF
    return {
        "qweight": pack_along_rows(weight.values()),
        "qzeros": pack_along_cols(zeros),
        "scales": weight.scales.to(torch.float16),
        "g_idx": weight.groups().to(torch.int32),
    }
