"""How much KV memory an Engine reserves: what it is configured to serve, never what another engine needs.

The rule (:func:`plan_kv_cache`):

1. ``num_blocks`` when given; else ``kv_cache_memory`` bytes when given;
2. else room for what the engine is configured to serve — ``max_num_seqs`` sequences of ``max_model_len``
   tokens — capped on CUDA by ``kv_cache_fraction`` of the device's *total* memory and by its *free* memory less
   a reserve for the engine's own activations (:func:`activation_reserve`), and on the CPU by 1 GiB.

So an engine for a small model or short contexts takes only what it can use, and a second engine (another
model, a pipeline beside a server, a test worker) still finds memory; a server that wants more asks for it
(``kv_cache_memory``, ``num_blocks`` or a larger ``kv_cache_fraction``). A model whose layers keep recurrent state
takes its ``max_num_seqs`` state slots first (``state_bytes``); the KV blocks get what is left. One whose layers
all keep recurrent state (Mamba) keeps no K/V: a sequence takes one block of ``max_model_len`` tokens, which holds
no memory (``num_blocks``, when given, still counts blocks of ``block_size`` tokens; ``kv_cache_memory`` is refused),
so its state slots alone bound the engine. One rule guards the default pool (:func:`_check_room`): the state slots
and one KV block fit in each bound (the CPU's 1 GiB; the device's fraction and its free memory less the
activations), else the engine is refused with the bound it missed — never given a block that holds no prompt.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from hfaccel.attention.functions import GATHER_BYTES
from hfaccel.kv.indexer import INDEXER_BYTES
from hfaccel.device import model_device
from hfaccel.kv import KVPool
from hfaccel.kv.latent import absorbed_layers
from hfaccel.kv.layout import ModelLayout, model_layout

CPU_POOL_BYTES = 1 << 30  # the default KV pool on the CPU: at most 1 GiB
GRAPHS_RESERVE = 1 << 30  # CUDA graph pools, compiled kernels' workspaces, allocator slack


@dataclass(frozen=True)
class KVBudget:
    """The pool an engine reserves, and why that size."""

    num_blocks: int
    block_size: int
    block_bytes: int  # one block, every layer, K and V
    reason: str
    state_bytes: int = 0  # the recurrent state slots of max_num_seqs sequences (hybrid models)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def stats(self) -> dict[str, int]:
        """What the pool reserved: tokens and bytes of KV, and bytes of recurrent state where there is any."""
        stats = {"kv_cache_tokens": self.tokens, "kv_cache_bytes": self.bytes}
        return {**stats, "state_bytes": self.state_bytes} if self.state_bytes else stats

    def __str__(self) -> str:
        state = f" and {_gib(self.state_bytes):.2f} GiB of recurrent state" if self.state_bytes else ""
        if not self.block_bytes:  # a recurrent-only model: its blocks only count sequences
            return f"no KV cache{state}: {self.reason}"
        return (
            f"KV cache of {self.tokens:,} tokens ({_gib(self.bytes):.2f} GiB, {self.num_blocks:,} blocks "
            f"of {self.block_size}){state}: {self.reason}"
        )


def activation_reserve(
    config,
    layout: ModelLayout,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int = 0,
    absorbed: Collection[int] = (),
) -> int:
    """Bytes an engine's own forward and sampling may need beside the pool (an estimate, with margin): twice a
    full-budget forward's hidden states, MLP and q/k/v activations (the widest attention layer's), the fp32 logits
    and sampling buffers of ``max_num_seqs`` rows, :data:`GRAPHS_RESERVE`, where layers expand latents (MLA) one
    layer's K/V expanded (keys, values and their copy for the kernel): from ``max_num_seqs`` sequences of
    ``max_model_len`` tokens where some latent layer is not read in the latent space (``absorbed``: every held token
    is expanded at each step), else from one forward's tokens (a prompt's prefill); and where a sparse-attention
    indexer scores each query against every key its sequence holds (``hfaccel.kv.indexer``), one call's scores and
    one chunk of the chosen keys read (each bounded)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = _global_int(text, "num_attention_heads", 1)
    width = max((kv.width for kv in layout.attention.values()), default=hidden // heads)
    kv_heads = max((kv.kv_heads for kv in layout.attention.values()), default=heads)
    per_token = 4 * hidden + 3 * _global_int(text, "intermediate_size", 4 * hidden) + (heads + 2 * kv_heads) * width
    logits = max_num_seqs * text.vocab_size * (4 + 4 + 8)  # logits, sorted probabilities, int64 order
    expanded = max((4 * heads * kv.expanded_dim for kv in layout.attention.values() if kv.latent), default=0)
    latent = [layer for layer, kv in layout.attention.items() if kv.latent]
    tokens = max_num_batched_tokens if set(latent) <= set(absorbed) else max_num_seqs * max_model_len
    expansion = tokens * expanded * dtype.itemsize
    indexing = INDEXER_BYTES + GATHER_BYTES if layout.indexers else 0
    return 2 * max_num_batched_tokens * per_token * dtype.itemsize + logits + GRAPHS_RESERVE + expansion + indexing


def _global_int(config, name: str, default: int) -> int:
    """A config field that may be missing or, in a per-layer config (Gemma 4), defined per layer: the default."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        value = None
    return int(value) if isinstance(value, int) else default


def plan_kv_cache(
    model,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    kv_cache_fraction: float = 0.5,
    kv_cache_dtype: torch.dtype | None = None,
) -> KVBudget:
    """The pool an engine over ``model`` reserves (module docstring), its K/V stored in ``kv_cache_dtype`` (default
    the model's). ``ValueError`` for settings that cannot hold one block, or that contradict each other."""
    if num_blocks is not None and kv_cache_memory is not None:
        raise ValueError(f"give num_blocks or kv_cache_memory, not both; got {num_blocks} and {kv_cache_memory}")
    if not 0 < kv_cache_fraction <= 1:
        raise ValueError(f"kv_cache_fraction must be in (0, 1]; got {kv_cache_fraction}")
    layout = model_layout(model)
    block_bytes = KVPool(layout, num_blocks=1, block_size=block_size, max_num_seqs=1).block_bytes(
        kv_cache_dtype or model.dtype
    )
    state_bytes = layout.state_bytes() * (max_num_seqs + 1)  # (and the scratch slot of padding rows)
    budget = lambda blocks, reason: KVBudget(blocks, block_size, block_bytes, reason, state_bytes)  # noqa: E731
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        return budget(num_blocks, "num_blocks given")
    if kv_cache_memory is not None:
        if not block_bytes:
            raise ValueError(
                f"kv_cache_memory does not apply to a model none of whose layers keeps K/V (its recurrent state "
                f"takes {layout.state_bytes()} bytes a sequence, max_num_seqs of them); got {kv_cache_memory}"
            )
        if kv_cache_memory < block_bytes:
            raise ValueError(
                f"kv_cache_memory must hold at least one block ({block_bytes} bytes); got {kv_cache_memory}"
            )
        return budget(kv_cache_memory // block_bytes, f"kv_cache_memory={kv_cache_memory} bytes given")
    bounds = _memory_bounds(
        model, layout, kv_cache_dtype, kv_cache_fraction, max_num_batched_tokens, max_num_seqs, max_model_len
    )
    _check_room(bounds, state_bytes, block_bytes, max_num_seqs)
    served = f"max_num_seqs={max_num_seqs} sequences of max_model_len={max_model_len} tokens"
    if not block_bytes:  # no layer keeps K/V (a recurrent-only model): blocks of max_model_len, holding no memory
        reason = f"room for {served}: no layer keeps K/V, so a block holds no memory and a sequence one block"
        # twice the sequences: the scheduler's watermark of free blocks never holds one back
        return KVBudget(2 * max_num_seqs, max_model_len, 0, reason, state_bytes)
    wanted = max_num_seqs * -(-max_model_len // block_size)
    blocks, tightest = min(((bound.bytes - state_bytes) // block_bytes, bound.name) for bound in bounds)
    if wanted <= blocks:
        return budget(wanted, f"room for {served}")
    return budget(blocks, f"{served} need {wanted:,} blocks; capped at {tightest}")


@dataclass(frozen=True)
class _Bound:
    """Memory an engine's pool (its state slots and KV blocks) must fit in, and what it is."""

    bytes: int
    name: str
    advice: str  # what raises it


def _memory_bounds(
    model, layout: ModelLayout, kv_cache_dtype, fraction: float, tokens: int, max_num_seqs: int, max_model_len: int
) -> list[_Bound]:
    """The default pool's bounds: 1 GiB on the CPU; on CUDA ``fraction`` of the device's total memory and its free
    memory less the engine's activations (:func:`activation_reserve`)."""
    device = model_device(model)
    if device.type != "cuda":
        return [_Bound(CPU_POOL_BYTES, "1 GiB on the CPU (the default pool)", "")]
    absorbed = absorbed_layers(model, layout, kv_cache_dtype)  # first: it may dequantize matrices (kv.latent)
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve(model.config, layout, model.dtype, tokens, max_num_seqs, max_model_len, absorbed)
    return [
        _Bound(
            int(total * fraction),
            f"kv_cache_fraction={fraction} of the device's {_gib(total):.1f} GiB",
            "raise kv_cache_fraction",
        ),
        _Bound(
            max(free - reserve, 0),
            f"the free {_gib(free):.2f} GiB less {_gib(reserve):.2f} GiB for the engine's activations",
            "free device memory",
        ),
    ]


def _gib(n: int) -> float:
    return n / (1 << 30)


def _check_room(bounds: list[_Bound], state_bytes: int, block_bytes: int, max_num_seqs: int) -> None:
    """The one rule of a default pool: the state slots of ``max_num_seqs`` sequences and one KV block (none where no
    layer keeps K/V) fit in every bound, else a ``RuntimeError`` naming the bound and what would make room."""
    for bound in bounds:
        if state_bytes + block_bytes <= bound.bytes:
            continue
        advice = ", ".join(filter(None, ["lower max_num_seqs", bound.advice]))
        if not state_bytes:
            raise RuntimeError(
                f"no memory is left for a KV cache: one block ({block_bytes} bytes) does not fit in "
                f"{bound.name}; {advice}, lower max_model_len (what multi-head latent attention expands grows with "
                "it), or give num_blocks / kv_cache_memory"
            )
        state = f"the recurrent state of max_num_seqs={max_num_seqs} sequences ({_gib(state_bytes):.2f} GiB)"
        if block_bytes:
            raise RuntimeError(
                f"{state} leaves no room for a KV block in {bound.name}; {advice}, or give num_blocks / kv_cache_memory"
            )
        raise RuntimeError(f"{state} does not fit in {bound.name}; {advice}")
