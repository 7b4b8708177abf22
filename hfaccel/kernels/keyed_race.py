"""Seeded sampling's draw in one kernel: the exponential race of a row's weights against Exp(1) noise keyed by a
counter-based hash — ``argmax_i(weights[i] / e_i)``, ``e_i = -log1p(-u_i)``, ``u_i`` the hash of (seed, stream,
purpose, counter, token ``i``) — without the ``[rows, vocab]`` noise ever being written: each of a row's programs
hashes its share of the tokens block by block, divides, and keeps the running winner (the first index among equal
scores, as ``torch.argmax``); the row's winner is the first token with the best of its programs' scores.

:func:`seeded_uniforms` is the hash (pure torch: the definition, used wherever numbers are needed on their own);
:func:`keyed_race_reference` the race it defines; :func:`keyed_race` picks the Triton kernel on CUDA (``auto``) and
the reference elsewhere — under ``TRITON_INTERPRET=1`` the interpreted kernel costs far more than the reference's
few tensor ops, so the tests run it explicitly (``backend="triton"``). The kernel's ``-log1p(-u)`` takes Kahan's form
(``-log(w) * u / (1 - w)``, ``w = 1 - u``: within a few ulps of ``log1p``), so kernel and reference agree on every
number to float32 rounding and pick the same token but at a near-tie of two scores that close — the same bound the
batch-invariance promise already has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels.runtime import num_sms, resolve_backend

M32 = 0xFFFFFFFF
START = 0x9E3779B9  # the hash's starting state: with 0, the key of all zeros would hash to 0 (u = 2**-33)
BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
BLOCK_V = 1024


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (xorshift-multiply rounds, constants < 2**31 so int64 products never overflow) of
    ``x`` in [0, 2**32) (a tensor or a Python int)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def seeded_uniforms(
    seeds: torch.Tensor | int,
    counters: torch.Tensor | int,
    tokens: torch.Tensor | int = 0,
    *,
    streams: torch.Tensor | int = 0,
    purpose: torch.Tensor | int = 0,
) -> torch.Tensor:
    """U(0, 1) float32 numbers, one per key (seed, stream, purpose, counter, token): int64 tensors or ints that
    broadcast together (at least one a tensor), seeds any int64, the others in [0, 2**32). A counter-based
    generator: the same key gives the same number on any device, in any batch, with no state.

    The hash of (seed, stream, purpose, counter) is a bijection of the counter for the rest fixed (a row's
    output indices never share numbers); a row's tokens get two more rounds, so that rows whose keys differ by
    a xor are not permutations of each other. 32 random bits: the numbers near 0 are as fine as 2**-33."""
    x = _mix32(((seeds >> 32) & M32) ^ START)
    x = _mix32(x ^ (seeds & M32))
    x = _mix32(x ^ streams)
    x = _mix32(x ^ purpose)
    x = _mix32(x ^ counters)
    x = _mix32(_mix32(x ^ tokens) ^ x)
    return ((x.to(torch.float32) + 0.5) * 2.0**-32).clamp_max(BELOW_ONE)  # in (0, 1): log1p(-u) finite


def keyed_noise(
    seeds: torch.Tensor | int,
    streams: torch.Tensor | int,
    counters: torch.Tensor,
    vocab: int,
    purpose: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Exp(1) race noise ``[S, vocab]`` (float32, > 0) of ``S`` keyed rows: ``counters [S]`` (int64, on the
    device the noise is made on) and ``seeds``, ``streams``, ``purpose`` (``[S]`` or one int for every row); entry
    ``(s, i)`` is keyed by (seed, stream, purpose, counter, token ``i``) — :func:`seeded_uniforms`."""
    column = lambda key: key[:, None] if isinstance(key, torch.Tensor) else key  # noqa: E731  [S] -> [S, 1]
    tokens = torch.arange(vocab, device=counters.device)  # [V]
    uniforms = seeded_uniforms(
        column(seeds), column(counters), tokens, streams=column(streams), purpose=column(purpose)
    )  # [S, V]
    return -torch.log1p(-uniforms)  # small numbers, the race's winners, from the finely spaced uniforms near 0


def keyed_race_reference(
    weights: torch.Tensor, seeds: torch.Tensor, streams: torch.Tensor, counters: torch.Tensor, purpose: torch.Tensor
) -> torch.Tensor:
    """``weights [S, V]`` (>= 0, float32) raced against the keyed Exp(1) noise of each row's key (``[S]`` int64
    each) -> the winning token of each row ``[S]`` int64: ``argmax(weights / keyed_noise)``."""
    return (weights / keyed_noise(seeds, streams, counters, weights.shape[-1], purpose)).argmax(-1)


@triton.jit
def _mix32_tl(x):
    """:func:`_mix32` on uint32 values (products wrap modulo 2**32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _keyed_race_kernel(
    weights_ptr,
    seeds_ptr,
    streams_ptr,
    counters_ptr,
    purpose_ptr,
    score_ptr,
    index_ptr,
    vocab,
    stride_row,
    blocks_per_chunk,
    START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, chunk): the race over the chunk's ``blocks_per_chunk`` blocks of the row's tokens -> its best
    score and the first token with it, at ``[row, chunk]`` of the partials (score -1 where the chunk has no token)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    x = _mix32_tl((seed >> 32).to(tl.uint32) ^ tl.full([], START, tl.uint32))
    x = _mix32_tl(x ^ seed.to(tl.uint32))
    x = _mix32_tl(x ^ tl.load(streams_ptr + row).to(tl.uint32))
    x = _mix32_tl(x ^ tl.load(purpose_ptr + row).to(tl.uint32))
    x = _mix32_tl(x ^ tl.load(counters_ptr + row).to(tl.uint32))
    best = tl.full([BLOCK], -1.0, tl.float32)  # per lane: the best score so far (weights >= 0 score >= 0)
    best_index = tl.zeros([BLOCK], tl.int32)
    lanes = tl.arange(0, BLOCK)
    first = chunk * blocks_per_chunk * BLOCK
    for start in range(first, tl.minimum(first + blocks_per_chunk * BLOCK, vocab), BLOCK):
        tokens = start + lanes  # [BLOCK]
        inside = tokens < vocab
        w = tl.load(weights_ptr + row * stride_row + tokens, mask=inside, other=0.0)
        h = _mix32_tl(_mix32_tl(x ^ tokens.to(tl.uint32)) ^ x)
        u = tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994039535522)  # 2**-32, BELOW_ONE
        rest = 1.0 - u
        noise = tl.where(rest == 1.0, u, -tl.log(rest) * (u / (1.0 - rest)))  # -log1p(-u), Kahan's form
        score = tl.where(inside, w / noise, -1.0)
        better = score > best  # strict: within a lane the earlier token keeps a tie
        best = tl.where(better, score, best)
        best_index = tl.where(better, tokens, best_index)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_index, vocab), axis=0)  # the first index among equal scores
    partial = row * tl.num_programs(1) + chunk
    tl.store(score_ptr + partial, top)
    tl.store(index_ptr + partial, winner.to(tl.int64))


def race_chunks(rows: int, vocab: int, device: torch.device) -> int:
    """How many programs race each row's tokens: enough that ``rows x chunks`` fill the device's SMs twice over (a
    batch-1 draw over a 128k vocabulary is otherwise one program streaming it all), each with whole blocks."""
    return max(1, min(triton.cdiv(max(vocab, 1), BLOCK_V), triton.cdiv(2 * num_sms(device), max(rows, 1))))


def keyed_race(
    weights: torch.Tensor,
    seeds: torch.Tensor | int,
    streams: torch.Tensor | int,
    counters: torch.Tensor,
    purpose: torch.Tensor | int = 0,
    *,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Per row of ``weights [S, V]`` (>= 0, any total, at least one > 0), the token that wins the race against
    Exp(1) noise keyed by (``seeds``, ``streams``, ``purpose``, ``counters``: ``[S]`` int64 tensors or one int for
    every row) -> ``[S]`` int64. Token ``i`` wins with probability ``weights[i] / sum(weights)``; the same key and
    weights give the same token in any batch. ``backend``: ``auto`` (the kernel on CUDA), ``triton`` or ``torch``.
    ``chunks``: the kernel's programs per row (default :func:`race_chunks`); the winner is the same for any."""
    rows, vocab = weights.shape
    # an int key is filled on the device (as_tensor would copy it from the host: a sync, and an error in a capture)
    keys = [
        key.to(torch.int64).expand(rows)
        if isinstance(key, torch.Tensor)
        else torch.full((rows,), key, dtype=torch.int64, device=weights.device)
        for key in (seeds, streams, counters, purpose)
    ]  # [S] each
    weights = weights.float()
    choice = resolve_backend(backend, weights.device) if backend != "auto" or weights.is_cuda else "torch"
    if choice == "torch" or rows == 0:
        return keyed_race_reference(weights, *keys)
    weights = weights.contiguous()
    blocks = triton.cdiv(max(vocab, 1), BLOCK_V)
    blocks_per_chunk = triton.cdiv(blocks, min(chunks or race_chunks(rows, vocab, weights.device), blocks))
    chunks = triton.cdiv(blocks, blocks_per_chunk)  # none empty
    scores = torch.empty(rows, chunks, dtype=torch.float32, device=weights.device)  # [S, C]: each chunk's best
    index = torch.empty(rows, chunks, dtype=torch.int64, device=weights.device)  # [S, C]: its first token
    _keyed_race_kernel[(rows, chunks)](
        weights,
        *(key.contiguous() for key in keys),
        scores,
        index,
        vocab,
        weights.stride(0),
        blocks_per_chunk,
        START=START,
        BLOCK=BLOCK_V,
    )
    if chunks == 1:
        return index[:, 0]
    top = scores.amax(-1, keepdim=True)  # [S, 1]
    return torch.where(scores == top, index, vocab).amin(-1)  # the first token among the chunks' equal bests
