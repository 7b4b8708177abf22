"""Causal attention of variable-length queries over a paged KV pool, with a split-K path for long contexts.

One kernel serves a batch that mixes decode tokens (1 query) and prefill chunks (many queries, causal within
the chunk, attending to the sequence's earlier blocks). Semantics (:func:`paged_attention_reference`):

- pool ``k_pool, v_pool: [num_blocks, block_size, Hkv, D]``; sequence ``s`` holds ``seq_lens[s]`` tokens,
  token ``j`` in block ``block_tables[s, j // block_size]`` at offset ``j % block_size``;
- its queries are its LAST ``q_len`` tokens (already written to the pool): query ``i`` sits at position
  ``seq_lens[s] - q_len + i`` and sees keys at positions ``<=`` its own (and ``> pos - sliding_window``; with
  ``chunk_size=c``, at or after its chunk's start ``(pos // c) * c``, as ``flash_attention`` defines);
- queries come either dense, ``q: [B, Hq, Sq, D]`` (one sequence per row, as transformers passes them;
  output ``[B, Sq, Hq, D]``), or packed, ``q: [T, Hq, D]`` with ``cu_seqlens_q: [S + 1]`` (output ``[T, Hq, D]``);
- ``key_mask: [S, >= max seq_len]`` bool hides keys (left padding of a generate() batch); GQA reads each KV head
  once for its ``Hq // Hkv`` query heads; softcap and scale as in ``flash_attention``; no visible key → zeros.

Where Triton cannot run, :func:`paged_attention_torch` serves the same semantics for the whole batch in a few torch
ops; :func:`paged_attention_reference` (one sequence at a time) is the definition both are checked against.

Split-K: with few (sequence, KV head) programs and long contexts, each program's key range is split over
``num_splits`` programs that write partial outputs and log-sum-exps, merged by a second small kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hfaccel.kernels import tuning
from hfaccel.kernels.attention_tiles import (
    BATCH_LADDER,
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
from hfaccel.kernels.flash_attention import SUPPORTED_DTYPES, flash_attention_reference
from hfaccel.kernels.runtime import interpreting, num_sms, resolve_backend
from hfaccel.kernels.write_kv import KV_QUANT_DTYPES, check_kv_scales, dequantize_kv

OP = "paged_attention"  # this kernel's name in the tuned tables (hfaccel.kernels.tuning)
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 32
# Decode batch sizes and contexts the tables are keyed by (a launch takes the first bucket >= its own, then the
# table's nearest measured one). The batch buckets are the sizes captured decode steps launch at.
BATCH_BUCKETS = BATCH_LADDER
CONTEXT_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
NEAREST = ("b", "ctx")  # the numeric fields of a key, in the order a lookup of the nearest bucket weighs them


@triton.jit
def _query_span(CU_SEQLENS_Q, seq_id, uniform_q_len, VARLEN: tl.constexpr):
    """(first query row, query count) of sequence ``seq_id``: packed (varlen) or one row per sequence."""
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + seq_id)
        q_len = tl.load(CU_SEQLENS_Q + seq_id + 1) - q_start
    else:
        q_start = 0
        q_len = uniform_q_len
    return q_start, q_len


@triton.jit
def _paged_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    row_ok,
    K_POOL,
    V_POOL,
    table,
    key_mask_row,
    kv_head,
    stride_bt_col,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_mask_col,
    head_dim,
    block_size,
    window,
    chunk,
    key_end,
    start,
    stop,
    score_scale,
    softcap_log2,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    """Attend the tile's rows to the sequence's keys ``[start, stop)`` (``start`` a multiple of ``BLOCK_N``; none at
    or past ``key_end``), gathered from the pool through the block table."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < key_end
        if MASKED:
            block = tl.load(table + (offs_n // block_size) * stride_bt_col, mask=n_ok, other=0)
        else:
            block = tl.load(table + (offs_n // block_size) * stride_bt_col)
        block = block.to(tl.int64)
        in_block = offs_n % block_size
        k = load_rows(
            K_POOL + kv_head * stride_kh,
            block * stride_kb + in_block * stride_ks,
            offs_d,
            stride_kd,
            n_ok,
            head_dim,
            MASKED,
            EVEN_D,
        )  # [BLOCK_N, BLOCK_D]
        v = load_rows(
            V_POOL + kv_head * stride_vh,
            block * stride_vb + in_block * stride_vs,
            offs_d,
            stride_vd,
            n_ok,
            head_dim,
            MASKED,
            EVEN_D,
        )
        if FP8_KV:  # stored over the head's scales: k's folds into the score scale, v's into the output
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            offs_n,
            offs_n,
            q_pos,
            row_ok,
            n_ok,
            key_mask_row,
            stride_mask_col,
            window,
            chunk,
            score_scale,
            softcap_log2,
            MASKED,
            True,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_SOFTCAP,
            HAS_KEY_MASK,
            UPCAST,
            IEEE_FP32,
        )
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    Q,
    K_POOL,
    V_POOL,
    O,
    BLOCK_TABLES,
    SEQ_LENS,
    CU_SEQLENS_Q,
    KEY_MASK,
    SINKS,
    PART_O,
    PART_LSE,
    K_SCALE,
    V_SCALE,
    stride_q_seq,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_o_seq,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_bt_col,
    stride_mask,
    stride_mask_col,
    stride_ps,
    stride_pseq,
    stride_pt,
    stride_ph,
    num_kv_heads,
    head_dim,
    block_size,
    uniform_q_len,
    window,
    chunk,
    score_scale,
    softcap_log2,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    # Program: BLOCK_M rows of (query, head-in-group) of one (sequence, KV head), one key split.
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    pid_split = tl.program_id(2)
    seq_id = pid_sh // num_kv_heads
    kv_head = pid_sh % num_kv_heads
    q_start, q_len = _query_span(CU_SEQLENS_Q, seq_id, uniform_q_len, VARLEN)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(SEQ_LENS + seq_id)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_base = Q + seq_id.to(tl.int64) * stride_q_seq
    q_rows = q_base + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_rows + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = seq_len - q_len + q_idx

    # Keys this program reads, [lo, hi) (its split of the tile's visible range), and the whole blocks every row
    # of the tile sees, [b, c).
    first_pos = seq_len - q_len + (pid_m * BLOCK_M) // GROUP
    last_pos = seq_len - q_len + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    hi = tl.minimum(seq_len, last_pos + 1)
    lo = 0
    seen_from = 0
    if HAS_WINDOW or HAS_CHUNK:
        lo = (key_floor(first_pos, window, chunk, HAS_WINDOW, HAS_CHUNK) // BLOCK_N) * BLOCK_N
        seen_from = key_floor(last_pos, window, chunk, HAS_WINDOW, HAS_CHUNK)
    if SPLIT:  # this program's share of the range the sequence really has (a captured step's launch is sized
        # for the longest sequence it may ever serve; the work follows the device-side length)
        per_split = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = lo + pid_split * per_split
        hi = tl.minimum(hi, lo + per_split)
    b, c = whole_blocks(lo, hi, first_pos + 1, seen_from, BLOCK_N, True, HAS_WINDOW or HAS_CHUNK)

    if FP8_KV:
        score_scale = score_scale * tl.load(K_SCALE + kv_head)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BLOCK_TABLES + seq_id.to(tl.int64) * stride_bt
    key_mask_row = KEY_MASK + seq_id.to(tl.int64) * stride_mask
    for phase in tl.static_range(3):
        start, stop = phase_bounds(phase, lo, b, c, hi)
        acc, m_i, l_i = _paged_range(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            row_ok,
            K_POOL,
            V_POOL,
            table,
            key_mask_row,
            kv_head,
            stride_bt_col,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_mask_col,
            head_dim,
            block_size,
            window,
            chunk,
            hi,
            start,
            stop,
            score_scale,
            softcap_log2,
            phase != 1,
            BLOCK_N,
            BLOCK_D,
            EVEN_D,
            HAS_WINDOW,
            HAS_CHUNK,
            HAS_SOFTCAP,
            HAS_KEY_MASK,
            UPCAST,
            IEEE_FP32,
            FP8_KV,
        )

    if HAS_SINKS and not SPLIT:  # split launches count the sinks where they combine the splits
        acc, l_i = fold_sink(acc, m_i, l_i, SINKS, head, row_ok)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8_KV:
        out = out * tl.load(V_SCALE + kv_head)
    if SPLIT:
        # partials: [num_splits, S, max_q_len, Hq, D] fp32, contiguous, and their log2-sum-exps
        # [num_splits, S, max_q_len, Hq], whose strides are the partials' divided by head_dim.
        part = pid_split * stride_ps + seq_id.to(tl.int64) * stride_pseq + q_idx * stride_pt + head * stride_ph
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(PART_LSE + part // head_dim, lse, mask=row_ok)
        tl.store(PART_O + part[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    else:
        o_base = O + seq_id.to(tl.int64) * stride_o_seq
        o_rows = o_base + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_rows + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(
    O,
    PART_O,
    PART_LSE,
    CU_SEQLENS_Q,
    SINKS,
    stride_o_seq,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ps,
    stride_pseq,
    stride_pt,
    stride_ph,
    max_q_len,
    uniform_q_len,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Program: one (sequence, query) row, one query head; merges every split at once by their log-sum-exps
    # ([BLOCK_S] weights, a [BLOCK_S, BLOCK_D] tile of partials: one pass, a fixed reduction order).
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq_id = pid // max_q_len
    q_idx = pid % max_q_len
    q_start, q_len = _query_span(CU_SEQLENS_Q, seq_id, uniform_q_len, VARLEN)
    if q_idx < q_len:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        splits = tl.arange(0, BLOCK_S)
        s_ok = splits < num_splits
        row = seq_id.to(tl.int64) * stride_pseq + q_idx * stride_pt + head * stride_ph + splits * stride_ps
        lse = tl.load(PART_LSE + row // head_dim, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
        m = tl.max(lse, 0)
        if HAS_SINKS:  # the sink: one more term of the softmax's sum, attached to no value
            sink = tl.load(SINKS + head)
            m = tl.maximum(m, sink)
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        weight = tl.math.exp2(lse - m_ref)
        parts = tl.load(PART_O + row[:, None] + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        total = tl.sum(weight, 0)
        if HAS_SINKS:
            total += tl.math.exp2(sink - m_ref)
        out = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
        o_ptr = O + seq_id.to(tl.int64) * stride_o_seq + (q_start + q_idx) * stride_ot + head * stride_oh
        tl.store(o_ptr + offs_d * stride_od, out.to(O.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class PagedConfig:
    """Tiles and launch parameters of one paged launch, and its split count (0: :func:`choose_num_splits`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 0


# Decode tiles ``hfaccel tune`` measures per head-dim class (16-bit inputs): (block_n, warps, stages); the first
# is the heuristic default. BLOCK_M follows the rows (query heads per KV head). Each compiles for sm_90.
DECODE_CANDIDATES = {
    128: [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3)],
    256: [(32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3)],
    512: [(32, 8, 1), (16, 4, 2), (32, 8, 2), (16, 8, 1)],
    1024: [(16, 8, 1), (16, 4, 1), (32, 8, 1)],
}
# a latent layer read absorbed (``hfaccel.kv.latent``) is one head as wide as its two latents: DeepSeek's 512 + 64
MAX_PAGED_HEAD_DIM = 1024


def _tile_rows(head_dim: int, rows: int) -> int:
    block_d = triton.next_power_of_2(head_dim)
    widest = 16 if block_d > 512 else 32 if block_d > 256 else 64 if block_d > 128 else 128
    return min(widest, max(16, triton.next_power_of_2(rows)))


def default_paged_config(head_dim: int, dtype: torch.dtype, rows: int) -> PagedConfig:
    """The heuristic tiles for ``rows = max_q_len * (Hq // Hkv)`` per program; splits chosen per launch."""
    block_m = _tile_rows(head_dim, rows)
    num_warps = 4 if block_m <= 32 else 8
    if dtype != torch.float32:
        return PagedConfig(block_m, DECODE_CANDIDATES[_head_dim_class(head_dim)][0][0], num_warps, 2)
    return PagedConfig(block_m, 16 if triton.next_power_of_2(head_dim) > 128 else 32, num_warps, 2)


def candidate_paged_configs(head_dim: int, dtype: torch.dtype, rows: int) -> list[PagedConfig]:
    """The decode tiles ``hfaccel tune`` measures (their split counts are swept separately)."""
    if dtype == torch.float32:
        return [default_paged_config(head_dim, dtype, rows)]
    block_m = _tile_rows(head_dim, rows)
    return [PagedConfig(block_m, *tile) for tile in DECODE_CANDIDATES[_head_dim_class(head_dim)]]


def _head_dim_class(head_dim: int) -> int:
    return min(c for c in DECODE_CANDIDATES if c >= triton.next_power_of_2(head_dim))


def choose_num_splits(num_programs: int, max_seqlen_k: int, block_n: int, num_sms: int) -> int:
    """Split each program's key range so that the (sequence, KV head, query tile) programs times the splits fill
    the GPU's ``num_sms`` SMs once (at batch 1, 8 KV heads: 17 splits on an H100's 132), with at least
    ``MIN_KEYS_PER_SPLIT`` keys per split, at most ``MAX_SPLITS``, and no split left empty by the rounding of
    its key range to whole ``block_n`` blocks. Depends on host ints only (the launch is fixed in a CUDA graph)."""
    if num_programs >= num_sms or max_seqlen_k < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    splits = min(MAX_SPLITS, -(-num_sms // num_programs), max_seqlen_k // MIN_KEYS_PER_SPLIT)
    return -(-max_seqlen_k // _keys_per_split(max_seqlen_k, splits, block_n))


def combine_warps(num_splits: int, head_dim: int) -> int:
    """Warps of the combine kernel: one per 1024 partial values it loads at once ([splits, head_dim] fp32)."""
    return min(8, max(1, triton.next_power_of_2(num_splits) * triton.next_power_of_2(head_dim) // 1024))


def _keys_per_split(max_seqlen_k: int, num_splits: int, block_n: int) -> int:
    return triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), num_splits), block_n) * block_n


def _bucket(value: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= value), buckets[-1])


def bucket_fields(head_dim: int, group: int, batch: int, max_seqlen_k: int, dtype: torch.dtype) -> dict:
    """The tuned table's bucket of a decode launch: head dim, query heads per KV head, batch and context buckets,
    dtype (in key order)."""
    return dict(
        d=head_dim, g=group, b=_bucket(batch, BATCH_BUCKETS), ctx=_bucket(max_seqlen_k, CONTEXT_BUCKETS), dtype=dtype
    )


def table_key(head_dim: int, group: int, batch: int, max_seqlen_k: int, dtype: torch.dtype) -> str:
    """The table key of a decode launch's bucket (:func:`bucket_fields`): ``"d128_g4_b8_ctx4096_dtypebfloat16"``."""
    return tuning.bucket_key(**bucket_fields(head_dim, group, batch, max_seqlen_k, dtype))


def tuned_entry(
    num_seqs: int, group: int, max_q: int, max_k: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> dict | None:
    """The GPU's tuned table's entry a launch takes (16-bit decode: one query per sequence), or None: heuristics."""
    if max_q != 1 or dtype == torch.float32:
        return None
    return tuning.lookup_nearest(OP, device, NEAREST, **bucket_fields(head_dim, group, num_seqs, max_k, dtype))


def plan_launch(
    num_seqs: int,
    heads_kv: int,
    group: int,
    max_q: int,
    max_k: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    config: PagedConfig | None = None,
) -> PagedConfig:
    """The configuration a launch runs with, its split count resolved: ``config`` (whose ``num_splits`` 0 means
    chosen), else the GPU's tuned table for 16-bit decode (one query per sequence; the measured bucket nearest
    the launch's, e.g. the longest context measured for a captured step sized for ``max_model_len``), else the
    heuristics."""
    rows = max_q * group
    if config is None:
        config = default_paged_config(head_dim, dtype, rows)
        entry = tuned_entry(num_seqs, group, max_q, max_k, head_dim, dtype, device)
        if entry is not None:
            config = PagedConfig(
                config.block_m, entry["block_n"], entry["num_warps"], entry["num_stages"], entry["num_splits"]
            )
    if config.num_splits:
        return config
    programs = num_seqs * heads_kv * triton.cdiv(rows, config.block_m)
    return replace(config, num_splits=choose_num_splits(programs, max_k, config.block_n, num_sms(device)))


def _check(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    key_mask,
    sliding_window,
    chunk_size,
    softcap,
    sinks,
    k_scale,
    v_scale,
):
    packed = cu_seqlens_q is not None
    if q.dim() != (3 if packed else 4):
        raise ValueError(
            "q must be [batch, heads, seq, head_dim] (dense) or [tokens, heads, head_dim] with "
            f"cu_seqlens_q (packed); got shape {tuple(q.shape)} "
            f"{'with' if packed else 'without'} cu_seqlens_q"
        )
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"k_pool and v_pool must both be [num_blocks, block_size, kv_heads, head_dim]; got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    heads_q, head_dim = (q.shape[1], q.shape[-1])
    if k_pool.shape[3] != head_dim or heads_q % k_pool.shape[2] != 0:
        raise ValueError(
            f"q has {heads_q} heads of dim {head_dim}; the pool has {k_pool.shape[2]} KV heads of dim "
            f"{k_pool.shape[3]} (query heads must be a multiple of KV heads, dims equal)"
        )
    quantized = k_pool.dtype in KV_QUANT_DTYPES
    if (
        head_dim > MAX_PAGED_HEAD_DIM
        or q.dtype not in SUPPORTED_DTYPES
        or k_pool.dtype != v_pool.dtype
        or not (quantized or q.dtype == k_pool.dtype)
    ):
        raise ValueError(
            f"q and the pools must share one of {SUPPORTED_DTYPES} (or the pools be one of "
            f"{KV_QUANT_DTYPES}, with scales) with head_dim <= {MAX_PAGED_HEAD_DIM}; got "
            f"{q.dtype}/{k_pool.dtype}/{v_pool.dtype}, head_dim {head_dim}"
        )
    check_kv_scales(k_pool, k_scale, v_scale, q.dtype)
    num_seqs = len(cu_seqlens_q) - 1 if packed else q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [{num_seqs}, max_blocks]; got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{num_seqs}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if packed and cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"cu_seqlens_q must be int32; got {cu_seqlens_q.dtype}")
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 2 or key_mask.shape[0] != num_seqs):
        raise ValueError(
            f"key_mask must be bool [{num_seqs}, max_seq_len]; got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    check_window(sliding_window, chunk_size)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float or None; got {softcap}")
    tensors = [q, k_pool, v_pool, block_tables, seq_lens] + [t for t in (cu_seqlens_q, key_mask) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted({str(t.device) for t in tensors})}")
    check_sinks(sinks, heads_q, q.device)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    backend: str = "auto",
    config: PagedConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of (dense or packed) queries over the paged pool; see the module docstring.

    ``max_seqlen_q`` (packed form) and ``max_seqlen_k`` are host-side bounds that size the launch without a
    device sync; ``num_splits`` forces the split-K factor and ``config`` the tiles (default:
    :func:`plan_launch`, from the tuned table or the launch size). An fp8 pool comes with its per-head
    ``k_scale, v_scale [Hkv]`` (``hfaccel.kernels.write_kv``): the kernel reads it as stored. Where Triton cannot
    run (the CPU), the ``torch`` backend serves the whole batch in a few tensor ops (:func:`paged_attention_torch`).
    """
    _check(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        key_mask,
        sliding_window,
        chunk_size,
        softcap,
        sinks,
        k_scale,
        v_scale,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if resolve_backend(backend, q.device) == "torch":
        return paged_attention_torch(
            q,
            k_pool,
            v_pool,
            block_tables,
            seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            scale=scale,
            key_mask=key_mask,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            softcap=softcap,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return _launch(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        key_mask,
        sliding_window,
        chunk_size,
        softcap,
        sinks,
        num_splits,
        config,
        k_scale,
        v_scale,
    )


def _launch(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    key_mask,
    sliding_window,
    chunk_size,
    softcap,
    sinks,
    num_splits,
    config,
    k_scale,
    v_scale,
):
    packed = cu_seqlens_q is not None
    heads_q, head_dim = q.shape[1], q.shape[-1]
    heads_kv = k_pool.shape[2]
    group = heads_q // heads_kv
    if packed:
        num_seqs = len(cu_seqlens_q) - 1
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        out = torch.empty(q.shape[0], heads_q, head_dim, dtype=q.dtype, device=q.device)
        q_strides = (0, q.stride(0), q.stride(1), q.stride(2))  # every sequence in "batch row" 0
        o_strides = (0, out.stride(0), out.stride(1), out.stride(2))
    else:
        num_seqs, max_q = q.shape[0], q.shape[2]
        out = torch.empty(num_seqs, max_q, heads_q, head_dim, dtype=q.dtype, device=q.device)
        q_strides = (q.stride(0), q.stride(2), q.stride(1), q.stride(3))
        o_strides = out.stride()
    if num_seqs == 0 or max_q == 0:
        return out
    max_k = int(max_seqlen_k) if max_seqlen_k is not None else int(seq_lens.max())
    if num_splits is not None:
        config = replace(config or default_paged_config(head_dim, q.dtype, max_q * group), num_splits=num_splits)
    cfg = plan_launch(num_seqs, heads_kv, group, max_q, max_k, head_dim, q.dtype, q.device, config)
    num_splits = cfg.num_splits
    split = num_splits > 1
    if split:
        part_o = torch.empty(num_splits, num_seqs, max_q, heads_q, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, num_seqs, max_q, heads_q, dtype=torch.float32, device=q.device)
        part_strides = part_o.stride()[:4]
    else:
        part_o = part_lse = out  # never touched
        part_strides = (0, 0, 0, 0)
    mask = key_mask if key_mask is not None else seq_lens
    sink_arg = sink_logits(sinks) if sinks is not None else seq_lens  # a placeholder pointer when there are none
    block_d = max(16, triton.next_power_of_2(head_dim))
    score_scale, softcap_log2 = score_scales(scale, softcap)
    flags = dict(
        VARLEN=packed,
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_KEY_MASK=key_mask is not None,
        HAS_SINKS=sinks is not None,
        SPLIT=split,
        UPCAST=q.dtype == torch.bfloat16 and interpreting() and not q.is_cuda,
        IEEE_FP32=q.dtype == torch.float32,
        FP8_KV=k_scale is not None,
    )
    grid = (triton.cdiv(max_q * group, cfg.block_m), num_seqs * heads_kv, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q if packed else seq_lens,
        mask,
        sink_arg,
        part_o,
        part_lse,
        *((k_scale, v_scale) if k_scale is not None else (seq_lens, seq_lens)),
        *q_strides,
        *o_strides,
        *k_pool.stride(),
        *v_pool.stride(),
        *block_tables.stride(),
        *(mask.stride() if key_mask is not None else (0, 0)),
        *part_strides,
        heads_kv,
        head_dim,
        k_pool.shape[1],
        max_q,
        sliding_window or 0,
        chunk_size or 1,
        score_scale,
        softcap_log2,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **flags,
    )
    if split:
        _combine_splits_kernel[(num_seqs * max_q, heads_q)](
            out,
            part_o,
            part_lse,
            cu_seqlens_q if packed else seq_lens,
            sink_arg,
            *o_strides,
            *part_strides,
            max_q,
            max_q,
            head_dim,
            num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
            VARLEN=packed,
            HAS_SINKS=sinks is not None,
            num_warps=combine_warps(num_splits, head_dim),
        )
    return out


def paged_attention_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` for every sequence of the call at once, in torch ops (the ``torch`` backend).

    Gathers each sequence's blocks into ``[S, Hkv, L, D]`` (``L``: the block table's width in keys, or fewer when
    ``max_seqlen_k`` bounds the lengths), builds one visibility mask from the lengths, query positions, key mask
    window and chunk, and runs SDPA with each KV head's query heads as rows (GQA without repeating K/V); with softcap or
    sinks, the same in explicit fp32 math. Packed queries are laid out one sequence per row first (``max_seqlen_q``
    rows: reads ``cu_seqlens_q`` on the host only when it is not given); a decode batch (one query per sequence) needs
    no layout at all. An fp8 pool's gathered keys and values are dequantized by ``k_scale, v_scale``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        max_seqlen_k,
        scale,
        key_mask,
        sliding_window,
        chunk_size,
        softcap,
        sinks,
        k_scale,
        v_scale,
    )
    if cu_seqlens_q is None:
        return _dense_torch(q, None, *args)
    num_seqs = len(cu_seqlens_q) - 1
    max_q = max_seqlen_q or (int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs else 0)
    if max_q == 1 and q.shape[0] == num_seqs:  # decode: one query per sequence, already in sequence order
        return _dense_torch(q[:, :, None], None, *args)[:, 0]  # [S, 1, Hq, D] -> [T, Hq, D]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
    owner = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens, output_size=q.shape[0])  # [T]
    row = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[owner]  # [T]: query index in its sequence
    padded = q.new_zeros(num_seqs, max_q, *q.shape[1:])  # [S, Q, Hq, D]
    padded[owner, row] = q
    return _dense_torch(padded.transpose(1, 2), q_lens, *args)[owner, row]  # [S, Q, Hq, D] -> [T, Hq, D]


def _dense_torch(
    q: torch.Tensor,
    q_lens: torch.Tensor | None,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_k: int | None,
    scale: float,
    key_mask: torch.Tensor | None,
    sliding_window: int | None,
    chunk_size: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Queries ``q [S, Hq, Q, D]`` (sequence ``s``'s first ``q_lens[s]`` rows real, all ``Q`` if None) over the
    pool -> ``[S, Q, Hq, D]``."""
    num_seqs, heads_q, num_q, head_dim = q.shape
    heads_kv, block_size = k_pool.shape[2], k_pool.shape[1]
    group = heads_q // heads_kv
    width = block_tables.shape[1]
    if max_seqlen_k is not None:
        width = min(width, -(-max_seqlen_k // block_size))
    table = block_tables[:, :width]  # [S, W]
    held = torch.arange(width, device=table.device) < (seq_lens[:, None] + block_size - 1) // block_size
    blocks = torch.where(held, table, 0)  # [S, W]: entries past a sequence's blocks are never read
    keys, values = (_gather_blocks(pool, blocks) for pool in (k_pool, v_pool))  # [S, Hkv, L, D]
    out_dtype = q.dtype
    if k_scale is not None:  # an fp8 pool: [S, Hkv, L, D] dequantized, the math in fp32 as the kernel does it
        keys, values = (
            dequantize_kv(t.transpose(1, 2), s, torch.float32).transpose(1, 2)
            for t, s in ((keys, k_scale), (values, v_scale))
        )
        q = q.float()
    visible = _visibility(
        seq_lens, num_q if q_lens is None else q_lens, num_q, keys.shape[2], key_mask, sliding_window, chunk_size
    )  # [S, Q, L]
    rows = q.reshape(num_seqs, heads_kv, group * num_q, head_dim)  # [S, Hkv, G * Q, D]: a KV head's query rows
    row_visible = visible[:, None, None].expand(-1, -1, group, -1, -1).flatten(2, 3)  # [S, 1, G * Q, L]
    if softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(rows, keys, values, attn_mask=row_visible, scale=scale)
        # a row that sees no key is zeros, as the kernel gives (CUDA's memory-efficient SDPA averages the values)
        out = torch.where(row_visible.any(-1, keepdim=True), out, 0.0)
    else:
        row_sinks = None if sinks is None else sinks.float().view(1, heads_kv, group).repeat_interleave(num_q, 2)
        out = _explicit_attention(rows, keys, values, row_visible, scale, softcap, row_sinks)
    out = out.view(num_seqs, heads_kv, group, num_q, head_dim).permute(0, 3, 1, 2, 4)  # [S, Q, Hkv, G, D]
    return out.reshape(num_seqs, num_q, heads_q, head_dim).to(out_dtype)


def _gather_blocks(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The pool's ``blocks [S, W]`` as each sequence's keys in order, ``[S, Hkv, W * block_size, D]``."""
    _, block_size, heads_kv, head_dim = pool.shape
    num_seqs, width = blocks.shape
    gathered = pool.index_select(0, blocks.flatten().long())  # [S * W, block_size, Hkv, D]
    return gathered.view(num_seqs, width * block_size, heads_kv, head_dim).transpose(1, 2)


def _visibility(
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor | int,
    num_q: int,
    num_keys: int,
    key_mask: torch.Tensor | None,
    sliding_window: int | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """Bool ``[S, Q, L]``: query row ``i`` of sequence ``s`` (at position ``seq_lens[s] - q_lens[s] + i``) sees
    key ``j``: causal, within the window and the chunk, not hidden by ``key_mask``. Keys past a sequence's length sit
    after its last query, so the causal rule hides them; rows past ``q_lens[s]`` are padding, discarded by the
    caller."""
    device = seq_lens.device
    first = (seq_lens - q_lens).long()  # [S]: position of each sequence's first query
    q_pos = first[:, None, None] + torch.arange(num_q, device=device)[None, :, None]  # [S, Q, 1]
    k_pos = torch.arange(num_keys, device=device)  # [L]
    visible = k_pos <= q_pos  # [S, Q, L]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    if chunk_size is not None:
        visible &= k_pos >= torch.div(q_pos, chunk_size, rounding_mode="floor") * chunk_size
    if key_mask is not None:
        cols = key_mask[:, :num_keys]  # [S, <= L]
        visible &= torch.nn.functional.pad(cols, (0, num_keys - cols.shape[1]))[:, None]
    return visible


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with ``softcap * tanh(scores / softcap)`` logits or sink logits (which SDPA cannot apply), in fp32:
    ``q [S, H, R, D]`` over ``k, v [S, H, L, D]`` with ``visible [S, 1, R, L]`` and ``sinks [1, H, R]`` ->
    ``[S, H, R, D]`` (zeros where a row sees no key)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [S, H, R, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    hidden = ~visible
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # one more logit per row, attached to no value
        scores = torch.cat([scores, sinks[..., None].expand(*scores.shape[:-1], 1)], -1)
    probs = scores.softmax(-1)[..., : visible.shape[-1]].masked_fill(hidden, 0.0)  # no NaN rows
    return torch.matmul(probs, v.float()).to(q.dtype)


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor, length: int):
    """Contiguous ``[Hkv, length, D]`` keys and values of one sequence (for references and fallbacks)."""
    size = k_pool.shape[1]
    blocks = block_table[: -(-length // size)].long()
    k = k_pool[blocks].flatten(0, 1)[:length]
    v = v_pool[blocks].flatten(0, 1)[:length]
    return k.transpose(0, 1), v.transpose(0, 1)


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch definition of :func:`paged_attention`: gather each sequence, then ``flash_attention_reference``
    (an fp8 pool dequantized first)."""
    if k_scale is not None:
        k_pool, v_pool = dequantize_kv(k_pool, k_scale, q.dtype), dequantize_kv(v_pool, v_scale, q.dtype)
    lens = seq_lens.tolist()
    if cu_seqlens_q is None:
        queries = [q[s : s + 1] for s in range(q.shape[0])]  # [1, Hq, Sq, D] each
    else:
        bounds = cu_seqlens_q.tolist()
        queries = [q[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(bounds, bounds[1:])]
    outs = []
    for s, query in enumerate(queries):
        k, v = gather_kv(k_pool, v_pool, block_tables[s], lens[s])
        mask = None if key_mask is None else key_mask[s : s + 1, : lens[s]]
        outs.append(
            flash_attention_reference(
                query,
                k[None],
                v[None],
                scale=scale,
                causal=True,
                q_offset=lens[s] - query.shape[2],
                key_mask=mask,
                sliding_window=sliding_window,
                chunk_size=chunk_size,
                softcap=softcap,
                sinks=sinks,
            )
        )
    if cu_seqlens_q is None:
        return torch.cat(outs) if outs else q.new_empty(0, q.shape[2], q.shape[1], q.shape[3])
    return torch.cat([o[0] for o in outs]) if outs else q.new_empty(0, q.shape[1], q.shape[2])
