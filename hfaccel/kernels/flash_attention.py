"""Flash attention of queries against a dense K/V (prefill, chunked prefill, decode against a dense cache).

Semantics (what :func:`flash_attention_reference` defines and the kernel computes):

- ``q: [B, Hq, Sq, D]``, ``k, v: [B, Hkv, Skv, D]`` with ``Hq % Hkv == 0``; query head ``h`` reads KV head
  ``h // (Hq // Hkv)`` (the ``repeat_kv`` order) without K/V ever being repeated in memory.
- Positions: query ``i`` sits at ``q_offset + i`` and key ``j`` at ``kv_offset + j``. With ``causal``, key j is
  visible to query i iff ``kpos <= qpos``; with ``sliding_window=w`` also iff ``kpos > qpos - w``; with
  ``chunk_size=c`` (chunked attention, Llama 4; causal only) also iff ``kpos >= (qpos // c) * c``, the start of
  the query's chunk (chunks of ``c`` positions counted from position 0).
- ``key_mask: [B, Skv]`` bool, False hides a key from every query of that row (left padding).
- Scores are ``(q . k) * scale``, then ``softcap * tanh(score / softcap)`` when ``softcap`` is set.
- ``sinks: [Hq]`` (attention sinks, gpt-oss's ``s_aux``): one more logit per query head in every row's softmax,
  attached to no value, so the keys' weights sum to less than one.
- A query that sees no key at all gets a zero output (never NaN).
- Output ``[B, Sq, Hq, D]`` (the layout transformers' attention functions return), in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hfaccel.kernels import tuning
from hfaccel.kernels.attention_tiles import (
    attend_block,
    check_sinks,
    check_window,
    fold_sink,
    key_floor,
    load_rows,
    phase_bounds,
    score_scales,
    sink_logits,
    whole_blocks,
)
from hfaccel.kernels.runtime import interpreting, resolve_backend, tma_descriptor, tma_supported

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512  # Gemma 4's global layers


@triton.jit
def _flash_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    row_ok,
    K,
    V,
    key_mask_row,
    batch,
    kv_head,
    k_base,
    v_base,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    stride_ms,
    seq_kv,
    head_dim,
    kv_offset,
    window,
    chunk,
    start,
    stop,
    score_scale,
    softcap_log2,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    TMA: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """Attend the tile's rows to the dense keys ``[start, stop)`` (``start`` a multiple of ``BLOCK_N``), read
    through TMA descriptors (zeros past the ends) or pointers."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_kv
        if TMA:
            k = K.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = V.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = load_rows(k_base, offs_n * stride_ks, offs_d, stride_kd, n_ok, head_dim, MASKED, EVEN_D)
            v = load_rows(v_base, offs_n * stride_vs, offs_d, stride_vd, n_ok, head_dim, MASKED, EVEN_D)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            offs_n,
            kv_offset + offs_n,
            q_pos,
            row_ok,
            n_ok,
            key_mask_row,
            stride_ms,
            window,
            chunk,
            score_scale,
            softcap_log2,
            MASKED,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_SOFTCAP,
            HAS_KEY_MASK,
            UPCAST,
            IEEE_FP32,
        )
    return acc, m_i, l_i


@triton.jit
def _flash_attention_kernel(
    Q,
    K,
    V,
    O,
    KEY_MASK,
    SINKS,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_mb,
    stride_ms,
    num_kv_heads,
    seq_q,
    seq_kv,
    head_dim,
    q_offset,
    kv_offset,
    window,
    chunk,
    score_scale,
    softcap_log2,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    TMA: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    # One program: BLOCK_M rows of the flattened (query, head-in-group) axis of one (batch, KV head).
    # Row r is query r // GROUP of query head kv_head * GROUP + r % GROUP, so the GROUP query heads
    # sharing a KV head read each K/V tile once. K and V are pointers, or TMA descriptors of the
    # [B, Hkv, Skv, D] tensors when TMA.
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the longest rows first, so the last wave is made of short ones
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < seq_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    q_ptrs = (
        Q
        + batch.to(tl.int64) * stride_qb
        + head[:, None] * stride_qh
        + q_idx[:, None] * stride_qs
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = q_offset + q_idx  # [BLOCK_M]

    # Key indices this tile can see at all, [lo, hi), and the whole blocks all its rows see, [b, c).
    first_pos = q_offset + (pid_m * BLOCK_M) // GROUP
    last_pos = q_offset + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, seq_q - 1)
    hi = seq_kv
    if IS_CAUSAL:
        hi = tl.minimum(seq_kv, tl.maximum(last_pos - kv_offset + 1, 0))
    lo = 0
    seen_from = 0
    if HAS_WINDOW or HAS_CHUNK:
        lo = tl.minimum(tl.maximum(0, key_floor(first_pos, window, chunk, HAS_WINDOW, HAS_CHUNK) - kv_offset), hi)
        lo = (lo // BLOCK_N) * BLOCK_N
        seen_from = key_floor(last_pos, window, chunk, HAS_WINDOW, HAS_CHUNK) - kv_offset
    b, c = whole_blocks(lo, hi, first_pos - kv_offset + 1, seen_from, BLOCK_N, IS_CAUSAL, HAS_WINDOW or HAS_CHUNK)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K
    v_base = V
    if not TMA:
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
    key_mask_row = KEY_MASK + batch.to(tl.int64) * stride_mb
    for phase in tl.static_range(3):
        start, stop = phase_bounds(phase, lo, b, c, hi)
        acc, m_i, l_i = _flash_range(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            row_ok,
            K,
            V,
            key_mask_row,
            batch,
            kv_head,
            k_base,
            v_base,
            stride_ks,
            stride_kd,
            stride_vs,
            stride_vd,
            stride_ms,
            seq_kv,
            head_dim,
            kv_offset,
            window,
            chunk,
            start,
            stop,
            score_scale,
            softcap_log2,
            phase != 1,
            BLOCK_N,
            BLOCK_D,
            EVEN_D,
            TMA,
            IS_CAUSAL,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_SOFTCAP,
            HAS_KEY_MASK,
            UPCAST,
            IEEE_FP32,
        )

    if HAS_SINKS:
        acc, l_i = fold_sink(acc, m_i, l_i, SINKS, head, row_ok)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = (
        O
        + batch.to(tl.int64) * stride_ob
        + q_idx[:, None] * stride_os
        + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class FlashConfig:
    """Tile sizes and launch parameters of one kernel configuration (``tma``: K/V through TMA descriptors where
    the GPU, the Triton and the tensors allow it; pointers otherwise)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


OP = "flash_attention"  # this kernel's name in the tuned tables (hfaccel.kernels.tuning)
SEQ_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)  # query lengths the tables are tuned at
MIN_TUNED_ROWS = 512  # calls with fewer rows per (batch, KV head) (decode, short chunks) use the heuristics

# The configurations ``hfaccel tune`` measures per head-dim class (16-bit inputs), (block_m, block_n, warps,
# stages), each with and without TMA; the first is the heuristic default. Every one compiles for sm_90
# (tests/kernels/test_flash_attention.py).
CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)],
    512: [(32, 32, 8, 2), (32, 32, 8, 1), (64, 32, 8, 1), (16, 32, 4, 2)],
}


def _head_dim_class(head_dim: int) -> int:
    return min(c for c in CANDIDATES if c >= triton.next_power_of_2(head_dim))


def candidate_configs(head_dim: int, dtype: torch.dtype) -> list[FlashConfig]:
    """What ``hfaccel tune`` measures for this head dim and dtype (fp32 is not tuned: its one heuristic)."""
    if dtype == torch.float32:
        return [default_config(head_dim, dtype, MIN_TUNED_ROWS)]
    return [FlashConfig(*shape, tma=tma) for shape in CANDIDATES[_head_dim_class(head_dim)] for tma in (False, True)]


def default_config(head_dim: int, dtype: torch.dtype, rows: int) -> FlashConfig:
    """The heuristic tiles for ``rows = Sq * (Hq // Hkv)`` rows per (batch, KV head).

    Sized for sm_80/sm_90 shared memory and kept at the minimum tile of 16 that ``tl.dot`` accepts on the GPU
    for short (decode) calls. 16-bit inputs start from the head-dim class's first candidate.
    """
    block_d = triton.next_power_of_2(head_dim)
    if dtype != torch.float32:
        cfg = FlashConfig(*CANDIDATES[_head_dim_class(head_dim)][0])
    elif block_d <= 128:
        cfg = FlashConfig(128, 32, 4 if block_d <= 64 else 8, 3 if block_d <= 64 else 2)
    elif block_d <= 256:
        cfg = FlashConfig(64, 16, 8, 2)
    else:
        cfg = FlashConfig(32, 16, 8, 1)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(rows)))
    return FlashConfig(block_m, cfg.block_n, cfg.num_warps if block_m > 32 else 4, cfg.num_stages)


def seq_bucket(seq: int) -> int:
    """The tuned query length a call of ``seq`` queries reads its table entry at."""
    return next((b for b in SEQ_BUCKETS if b >= seq), SEQ_BUCKETS[-1])


def bucket_fields(head_dim: int, group: int, seq: int, dtype: torch.dtype) -> dict:
    """The tuned table's bucket of a call: head dim, query heads per KV head, query-length bucket, dtype (in key
    order)."""
    return dict(d=head_dim, g=group, s=seq_bucket(seq), dtype=dtype)


def table_key(head_dim: int, group: int, seq: int, dtype: torch.dtype) -> str:
    """The table key of a call's bucket (:func:`bucket_fields`): ``"d128_g4_s2048_dtypefloat16"``."""
    return tuning.bucket_key(**bucket_fields(head_dim, group, seq, dtype))


def tuned_entry(
    head_dim: int, group: int, seq: int, dtype: torch.dtype, device: torch.device | str | None
) -> dict | None:
    """The GPU's tuned entry for a call: its bucket's, else the measured query length nearest it (same head dim,
    group and dtype); None without one."""
    return tuning.lookup_nearest(OP, device, ("s",), **bucket_fields(head_dim, group, seq, dtype))


def pick_config(
    head_dim: int, dtype: torch.dtype, seq_q: int, group: int, device: torch.device | str | None = None
) -> FlashConfig:
    """The configuration of a call: the GPU's tuned table for long 16-bit calls (:func:`tuned_entry`), else
    :func:`default_config`."""
    rows = seq_q * group
    if rows >= MIN_TUNED_ROWS and dtype != torch.float32:
        entry = tuned_entry(head_dim, group, seq_q, dtype, device)
        if entry is not None:
            return FlashConfig(
                entry["block_m"],
                entry["block_n"],
                entry["num_warps"],
                entry["num_stages"],
                bool(entry.get("tma", False)),
            )
    return default_config(head_dim, dtype, rows)


def sdpa_preferred(head_dim: int, group: int, seq: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether torch SDPA should serve a plain causal prefill (no padding, window or softcap) of this shape on
    ``device``: the tuned table's measurement of both (``sdpa_us`` against ``us``) at the call's bucket or the
    nearest measured (:func:`tuned_entry`); without one, True — on the one GPU measured (H100,
    notes/gpu-measured-2026-11-23.md) SDPA was the faster at every prefill shape."""
    entry = tuned_entry(head_dim, group, seq, dtype, device)
    if entry is None or "sdpa_us" not in entry:
        return True
    return entry["sdpa_us"] <= entry["us"]


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES}; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, heads_q, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v must be [batch={batch}, kv_heads, seq_kv, head_dim={head_dim}]; got {tuple(k.shape)}")
    if heads_q % k.shape[1] != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of KV heads ({k.shape[1]})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}; got {head_dim}")
    if key_mask is not None:
        if key_mask.shape != (batch, k.shape[2]) or key_mask.dtype != torch.bool:
            raise ValueError(
                f"key_mask must be a bool tensor of shape {(batch, k.shape[2])}; "
                f"got {key_mask.dtype} {tuple(key_mask.shape)}"
            )
        if key_mask.device != q.device:
            raise ValueError(f"key_mask must be on {q.device}; got {key_mask.device}")
    check_window(sliding_window, chunk_size, causal)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float or None; got {softcap}")
    check_sinks(sinks, heads_q, q.device)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int = 0,
    kv_offset: int = 0,
    key_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    config: FlashConfig | None = None,
) -> torch.Tensor:
    """Attention of ``q: [B, Hq, Sq, D]`` over ``k, v: [B, Hkv, Skv, D]``; returns ``[B, Sq, Hq, D]``.

    See the module docstring for the exact semantics. ``backend``: ``"auto"`` (Triton where it can run,
    else the torch reference), ``"triton"`` or ``"torch"``. ``config``: the kernel's tiles (default:
    :func:`pick_config`; ``hfaccel tune`` and the tests pass their own).
    """
    _check_inputs(q, k, v, key_mask, causal, sliding_window, chunk_size, softcap, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if resolve_backend(backend, q.device) == "torch":
        return flash_attention_reference(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            q_offset=q_offset,
            kv_offset=kv_offset,
            key_mask=key_mask,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            softcap=softcap,
            sinks=sinks,
        )
    return _launch(
        q,
        k,
        v,
        scale,
        causal,
        int(q_offset),
        int(kv_offset),
        key_mask,
        sliding_window,
        chunk_size,
        softcap,
        sinks,
        config,
    )


def _launch(
    q, k, v, scale, causal, q_offset, kv_offset, key_mask, sliding_window, chunk_size, softcap, sinks, config
) -> torch.Tensor:
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    out = torch.empty(batch, seq_q, heads_q, head_dim, dtype=q.dtype, device=q.device)
    if seq_q == 0 or batch == 0:
        return out
    cfg = config or pick_config(head_dim, q.dtype, seq_q, group, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    k_arg, v_arg = _kv_arguments(k, v, cfg, block_d)
    mask = key_mask if key_mask is not None else q  # placeholder pointer, never read
    mask_strides = key_mask.stride() if key_mask is not None else (0, 0)
    grid = (triton.cdiv(seq_q * group, cfg.block_m), batch * heads_kv)
    _flash_attention_kernel[grid](
        q,
        k_arg,
        v_arg,
        out,
        mask,
        sink_logits(sinks) if sinks is not None else q,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *mask_strides,
        heads_kv,
        seq_q,
        seq_kv,
        head_dim,
        q_offset,
        kv_offset,
        sliding_window or 0,
        chunk_size or 1,
        *score_scales(scale, softcap),
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        TMA=k_arg is not k,
        IS_CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_KEY_MASK=key_mask is not None,
        HAS_SINKS=sinks is not None,
        UPCAST=q.dtype == torch.bfloat16 and interpreting() and not q.is_cuda,
        IEEE_FP32=q.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _kv_arguments(k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, block_d: int):
    """What the kernel reads K and V through: TMA descriptors when the config asks for them and the device and
    both tensors allow it (16-bit, aligned), else the tensors themselves (pointers)."""
    if cfg.tma and k.dtype != torch.float32 and tma_supported(k.device):
        box = [1, 1, cfg.block_n, block_d]
        k_desc, v_desc = tma_descriptor(k, box), tma_descriptor(v, box)
        if k_desc is not None and v_desc is not None:
            return k_desc, v_desc
    return k, v


def visibility_mask(
    batch: int,
    seq_q: int,
    seq_kv: int,
    *,
    causal: bool,
    q_offset: int,
    kv_offset: int,
    key_mask: torch.Tensor | None,
    sliding_window: int | None,
    device: torch.device,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Bool ``[B, 1, Sq, Skv]``: True where query i may attend key j (the rule the kernel applies)."""
    q_pos = torch.arange(seq_q, device=device)[:, None] + q_offset
    k_pos = torch.arange(seq_kv, device=device)[None, :] + kv_offset
    visible = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    if chunk_size is not None:
        visible &= k_pos >= torch.div(q_pos, chunk_size, rounding_mode="floor") * chunk_size
    visible = visible.expand(batch, 1, seq_q, seq_kv)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    return visible


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int = 0,
    kv_offset: int = 0,
    key_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch definition of :func:`flash_attention` (fp32 math, GQA by broadcasting, not repeating)."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = head_dim**-0.5 if scale is None else scale
    if seq_kv == 0:  # no key at all: every query sees nothing and returns zeros
        return q.new_zeros(batch, seq_q, heads_q, head_dim)
    sink = None if sinks is None else sinks.float().view(1, heads_kv, group, 1, 1)
    qf = q.float().view(batch, heads_kv, group, seq_q, head_dim)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qf, k.float()) * scale  # [B, Hkv, G, Sq, Skv]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visibility_mask(
        batch,
        seq_q,
        seq_kv,
        causal=causal,
        q_offset=int(q_offset),
        kv_offset=int(kv_offset),
        key_mask=key_mask,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        device=q.device,
    )
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    row_max = scores.amax(-1, keepdim=True) if sink is None else torch.maximum(scores.amax(-1, keepdim=True), sink)
    row_max = torch.where(row_max.isinf(), 0.0, row_max)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(-1, keepdim=True) + (0.0 if sink is None else torch.exp(sink - row_max))
    probs = probs / torch.where(denom > 0, denom, 1.0)
    out = torch.einsum("bhgqk,bhkd->bqhgd", probs, v.float())  # [B, Sq, Hkv, G, D]
    return out.reshape(batch, seq_q, heads_q, head_dim).to(q.dtype)


def attention_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs of one attention forward (two GEMMs; causal counts half the square when Sq == Skv)."""
    flops = 4.0 * batch * heads * seq_q * seq_kv * head_dim
    if causal and seq_q == seq_kv:
        flops /= 2
    return flops


__all__ = [
    "FlashConfig",
    "attention_flops",
    "candidate_configs",
    "check_sinks",
    "check_window",
    "default_config",
    "flash_attention",
    "flash_attention_reference",
    "pick_config",
    "sdpa_preferred",
    "sink_logits",
    "visibility_mask",
]
