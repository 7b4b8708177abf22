"""What the attention kernels share (``flash_attention`` and ``paged_attention``): the Triton tile functions of the
online softmax (scores with softcap, one softmax step, a sink folded in, the visible keys of a tile under causal /
window / chunk rules, the bounds of the unmasked and masked phases, row loads), the host-side checks of their
window, chunk and sink arguments, and the decode batch ladder both the tables and the captured steps use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Decode batch sizes: the sizes captured decode steps launch at (hfaccel.runner.graphs pads a batch up to the
# next) and the batch buckets of the paged kernel's tuned table.
BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@triton.jit
def tanh_sigmoid(x):
    # tanh through sigmoid: exact enough in fp32 and available both compiled and interpreted.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def log2_scores(q, k_t, score_scale, softcap_log2, HAS_SOFTCAP: tl.constexpr, IEEE_FP32: tl.constexpr):
    """``q [M, D] @ k_t [D, N]`` scaled into the log2 domain (``c * tanh(s / c)`` first when softcapped)."""
    if IEEE_FP32:
        s = tl.dot(q, k_t, input_precision="ieee")
    else:
        s = tl.dot(q, k_t)
    if HAS_SOFTCAP:
        s = softcap_log2 * tanh_sigmoid(s * score_scale)
    else:
        s = s * score_scale
    return s


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, GUARD: tl.constexpr, IEEE_FP32: tl.constexpr):
    """Fold log2 scores ``s [M, N]`` and values ``v [N, D]`` into the running row max ``m_i``, row sum ``l_i`` and
    unnormalised output ``acc``. ``GUARD``: some scores may be -inf (hidden keys), so a row may have seen no key
    yet; its max stays -inf and it adds zeros instead of NaN. Without it (a block every row sees whole) the
    rescaling needs no check."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE_FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def fold_sink(acc, m_i, l_i, SINKS, head, row_ok):
    """Count each row's sink logit (``SINKS[head]``, in the log2 domain) in its softmax: ``acc`` and ``l_i``
    rescaled to the new row max, ``l_i`` plus the sink's weight (a row that saw no key then sums to the sink's)."""
    sink = tl.load(SINKS + head, mask=row_ok, other=0.0)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m_new)


@triton.jit
def key_floor(pos, window, chunk, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """The first key position a query at ``pos`` (>= 0) may see under the window and the chunk (0 without
    either); non-decreasing in ``pos``, so a tile's first and last rows bound its range."""
    floor = pos * 0
    if HAS_WINDOW:
        floor = tl.maximum(floor, pos - window + 1)
    if HAS_CHUNK:
        floor = tl.maximum(floor, (pos // chunk) * chunk)
    return floor


@triton.jit
def visible_keys(
    k_pos,
    q_pos,
    key_ok,
    row_ok,
    n_ok,
    window,
    chunk,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
):
    """Bool ``[M, N]``: which keys of a block each row may attend (bounds, causal, window, chunk, key mask)."""
    visible = n_ok[None, :] & row_ok[:, None]
    if IS_CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW or HAS_CHUNK:
        visible = visible & (k_pos[None, :] >= key_floor(q_pos, window, chunk, HAS_WINDOW, HAS_CHUNK)[:, None])
    if HAS_KEY_MASK:
        visible = visible & key_ok[None, :]
    return visible


@triton.jit
def whole_blocks(
    lo, hi, seen_below, seen_from, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_FLOOR: tl.constexpr
):
    """Split a tile's key range ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``) at ``b <= c``: ``[b, c)`` are whole
    ``BLOCK_N`` blocks that every row of the tile sees (key indices below ``seen_below`` under causality, from
    ``seen_from`` on under a window or chunk), so only ``[lo, b)`` and ``[c, hi)`` need masks. Divisions see only
    values >= 0 (Triton's integer division truncates)."""
    full_hi = hi
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, seen_below)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    full_lo = lo
    if HAS_FLOOR:
        full_lo = tl.maximum(lo, ((tl.maximum(seen_from, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    b = tl.minimum(full_lo, hi)
    c = tl.minimum(tl.maximum(full_hi, b), hi)
    return b, c


@triton.jit
def phase_bounds(phase: tl.constexpr, lo, b, c, hi):
    """The keys of one of a tile's three loop phases (``phase != 1`` masked): [lo, b), [b, c), [c, hi)."""
    if phase == 0:
        start, stop = lo, b
    elif phase == 1:
        start, stop = b, c
    else:
        start, stop = c, hi
    return start, stop


@triton.jit
def load_rows(base, rows, offs_d, stride_d, rows_ok, head_dim, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """``[N, BLOCK_D]`` from ``base + rows[n] + d * stride_d``, masked only where rows may be out of range
    (``MASK_ROWS``) or the head dim is padded."""
    ptrs = base + rows[:, None] + offs_d[None, :] * stride_d
    if MASK_ROWS or not EVEN_D:
        tile = tl.load(ptrs, mask=rows_ok[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def attend_block(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    offs_n,
    k_pos,
    q_pos,
    row_ok,
    n_ok,
    key_mask_row,
    stride_ms,
    window,
    chunk,
    score_scale,
    softcap_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """One key block ``k, v [BLOCK_N, BLOCK_D]`` folded into the tile's softmax state. ``MASKED``: the whole
    visibility rule applies; otherwise every row sees every key of the block and only the key mask can hide."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = log2_scores(q, tl.trans(k), score_scale, softcap_log2, HAS_SOFTCAP, IEEE_FP32)  # [BLOCK_M, BLOCK_N]
    key_ok = n_ok
    if HAS_KEY_MASK:
        key_ok = tl.load(key_mask_row + offs_n * stride_ms, mask=n_ok, other=0) != 0
    if MASKED:
        s = tl.where(
            visible_keys(
                k_pos, q_pos, key_ok, row_ok, n_ok, window, chunk, IS_CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_KEY_MASK
            ),
            s,
            float("-inf"),
        )
    elif HAS_KEY_MASK:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, MASKED or HAS_KEY_MASK, IEEE_FP32)
    return acc, m_i, l_i


def check_sinks(sinks: torch.Tensor | None, heads_q: int, device: torch.device) -> None:
    """``sinks`` must be one logit per query head on the queries' device (or None)."""
    if sinks is not None and (sinks.shape != (heads_q,) or sinks.device != device or not sinks.is_floating_point()):
        raise ValueError(
            f"sinks must be a float tensor of shape ({heads_q},) (one logit per query head) on {device}; "
            f"got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )


def sink_logits(sinks: torch.Tensor) -> torch.Tensor:
    """The kernels' sinks: fp32, in the log2 domain of their scores."""
    return (sinks.float() * LOG2E).contiguous()


def check_window(sliding_window: int | None, chunk_size: int | None, causal: bool = True) -> None:
    """``sliding_window`` and ``chunk_size`` must each be a positive int or None; chunks only with causality."""
    for name, size in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
        if size is not None and (isinstance(size, bool) or int(size) != size or size < 1):
            raise ValueError(f"{name} must be a positive int or None; got {size!r}")
    if chunk_size is not None and not causal:
        raise ValueError("chunk_size (chunked attention) needs causal=True")


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(score_scale, softcap_log2): the kernel's log2-domain factors for ``softcap * tanh(qk * scale / softcap)``."""
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E
