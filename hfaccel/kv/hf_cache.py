"""transformers ``Cache`` views over a :class:`~hfaccel.kv.pool.KVPool`.

- :class:`PagedCache`, for ``generate``: usable by any model (``model.generate(..., cache=PagedCache(
  model.config, max_batch_size=B, max_cache_len=L))``, ``past_key_values=`` before transformers 5.24); each batch
  row is one sequence of the pool, blocks are allocated as tokens arrive.
- :class:`PromptCache`, for a prompt's prefill through the model's own forward (a multimodal one's: its images
  encoded and merged as transformers does it) into sequences of a pool whose slots are reserved: a left-padded batch,
  row ``b``'s real tokens written to sequence ``seq_ids[b]`` from position 0.
- :class:`SequenceKVCache`, for hfaccel's :class:`~hfaccel.runner.ModelRunner`: any number of independent
  sequences packed into one ``[1, T]`` row; the runner sets each forward's metadata (``step``).

Both write new K/V into the pool by slot mapping (``hfaccel.kernels.write_kv``). What a layer's ``update``
returns depends on who reads it: an attention function that declares it reads the pool (hfaccel's, through
the attribute named by :data:`PAGED_READER_ATTRIBUTE`) gets a :class:`PagedKV` — the paged kernel reads K/V
straight from the blocks, no gather, no copy, no ``repeat_kv``; any other attention (sdpa, eager, ...) gets
ordinary ``[B, Hkv, S, D]`` tensors gathered from the pool.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hfaccel import compat
from hfaccel.kernels.write_kv import KV_QUANT_DTYPES, dequantize_kv
from hfaccel.kv.block_manager import BlockManager, CacheFullError, slot_mapping
from hfaccel.kv.fp8 import KVScales
from hfaccel.kv.layout import own_cache_class
from hfaccel.kv.pool import KVPool, PackedStep
from hfaccel.kv.state import StateStep, StateView

# An attention function that reads PagedKV carries this attribute; its value is the kernel backend ("auto",
# "triton" or "torch") the cache then also writes with.
PAGED_READER_ATTRIBUTE = "hfaccel_kernel_backend"


def paged_reader_backend(config) -> str | None:
    """The kernel backend of the model's attention when that attention reads :class:`PagedKV`, else None."""
    function = compat.attention_function(compat.attn_implementation(config))
    return getattr(function, PAGED_READER_ATTRIBUTE, None)


@dataclass(frozen=True)
class PagedKV:
    """One layer's view of the pool, handed to hfaccel's attention instead of K/V tensors."""

    kv_cache: torch.Tensor  # [L_g, 2, num_blocks, block_size, Hkv, D]: the pool tensor holding the layer
    layer: int  # the layer's index in ``kv_cache`` (the kernels index it)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32 (tokens held, including this forward's)
    max_seq_len: int  # host copy of seq_lens.max()
    # On a forward that fills empty rows (a prompt's prefill; packed: one sequence's whole prompt) the new K/V are
    # the whole cache: attention can read these dense [B, Hkv, S, D] tensors directly instead of the pool.
    dense: tuple[torch.Tensor, torch.Tensor] | None = None
    # Packed queries (the runner): the forward's new tokens of all sequences in one row; sequence s owns query
    # rows cu_seqlens_q[s]:cu_seqlens_q[s + 1]. None: one sequence per batch row.
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32
    max_seqlen_q: int = 0
    # Left padding the pool does not hold (a PagedCache told the rows' padding): row b's token at cache position
    # c is its held token c - padding[b], every held key is real, and the rows span ``padded_len`` positions.
    padding: torch.Tensor | None = None  # [B] int64
    padded_len: int = 0
    # the layer's sliding window or attention chunk as its cache holds it (``hfaccel.kv.layout``), for models whose
    # attention call does not pass it (their masks alone apply it)
    window: int | None = None
    chunk: int | None = None
    # a quantized pool's (fp8): the group's per-head scales [L_g, 2, Hkv] fp32, and the dtype its K/V read back in
    kv_scales: torch.Tensor | None = None
    dtype: torch.dtype | None = None

    def to(self, device: torch.device | str, *args, **kwargs) -> PagedKV:
        """Itself, on the pool's device: a layer that reads another layer's K/V moves them to its own device first
        (Gemma 4's shared layers, transformers 5.17), and hfaccel serves a model on one device."""
        device = torch.device(device)
        held = self.kv_cache.device
        if device.type != held.type or device.index not in (None, held.index):
            raise ValueError(f"hfaccel's KV pool lives on {held}; a layer asked for its K/V on {device}")
        return self

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values ``[B, Hkv, S, D]`` (for attention paths that need them contiguous; a quantized
        pool's dequantized)."""
        if self.dense is not None:
            return self.dense
        pools = self.kv_cache[self.layer]  # [2, num_blocks, block_size, Hkv, D]
        if self.kv_scales is not None:
            pools = torch.stack([dequantize_kv(pools[i], self.kv_scales[self.layer, i], self.dtype) for i in (0, 1)])
        size = pools.shape[2]
        if self.padding is not None:  # transformers' layout: cache position c of row b, zeros for its padding
            held = torch.arange(self.padded_len, device=self.padding.device)[None] - self.padding[:, None]  # [B, S]
            rows = torch.arange(held.shape[0], device=held.device)[:, None]
            slots = slot_mapping(self.block_tables, rows, held.clamp(min=0), size)  # [B, S]
            flat = pools.flatten(1, 2)[:, slots] * (held >= 0)[None, :, :, None, None]  # [2, B, S, Hkv, D]
            return flat[0].transpose(1, 2), flat[1].transpose(1, 2)
        length = self.max_seq_len
        blocks = self.block_tables[:, : -(-length // size)].long()  # [B, n_blocks]
        keys = pools[0, blocks].flatten(1, 2)[:, :length]  # [B, S, Hkv, D]
        values = pools[1, blocks].flatten(1, 2)[:, :length]
        return keys.transpose(1, 2), values.transpose(1, 2)


class CacheLayerView(CacheLayerMixin):
    """What transformers sees per layer of a :class:`PoolCache`: each call goes to the cache with this layer's
    index."""

    def __init__(self, cache: PoolCache, layer_idx: int):
        super().__init__()
        self._cache = weakref.ref(cache)  # the cache holds its layers: no cycle keeps a dropped pool alive
        self.layer_idx = layer_idx
        self.is_initialized = True

    @property
    def cache(self) -> PoolCache:
        return self._cache()

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.cache.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return self.cache.get_max_length(self.layer_idx)


class PoolCache(Cache):
    """The base of hfaccel's caches: a transformers ``Cache`` whose layers live in a :class:`KVPool`.

    A subclass says where this forward's new tokens go (:meth:`_begin_layer`); the base writes them and returns
    what the model's attention reads (module docstring).
    """

    def __init__(self, config, pool: KVPool):
        self.config = config
        self.pool = pool
        # Cache's own initialiser by name: a model's own cache class may follow in the MRO (sequence_cache)
        Cache.__init__(self, layers=[CacheLayerView(self, i) for i in range(pool.num_layers)])

    @property
    def manager(self) -> BlockManager:
        return self.pool.manager

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [B, Hkv, S_new, D]
        paged, slots = self._begin_layer(key_states, value_states, layer_idx)
        backend = paged_reader_backend(self.config)
        self.pool.write(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2), slots,
                        backend=backend or "auto")
        if backend is not None:
            return paged, paged
        return paged.gather()

    def _begin_layer(self, key_states: torch.Tensor, value_states: torch.Tensor,
                     layer_idx: int) -> tuple[PagedKV, torch.Tensor]:
        """The layer's view for this forward, and the slots ``[B, S_new]`` its new tokens go to."""
        raise NotImplementedError


class PagedCache(PoolCache):
    """Paged KV cache for ``generate`` (see the module docstring).

    Args:
        config: the model's config (its text config is used for layers, KV heads and head dim).
        max_batch_size: the most rows (batch × beams × return sequences) it will hold.
        max_cache_len: the most tokens per row (prompt + new tokens).
        num_blocks: pool size in blocks; default ``max_batch_size * ceil(max_cache_len / block_size)``.
        block_size: token slots per block.
        device, dtype: of the pool; default: those of the first keys written (the pool is then created lazily).
            ``dtype=torch.float8_e4m3fn`` stores K/V in fp8 with per-head scales (half the bytes; attention reads
            them back in the keys' dtype).
        kv_scales: an fp8 cache's scales (``hfaccel.kv.fp8``): None (1.0), a number, ``"prefill"`` (each layer's
            from its first forward) or ``{layer: [2, Hkv or 1]}``.
        left_padding: tokens of left padding of each row of the first forward (``generate`` of an accelerated
            model passes them): when the model's attention is hfaccel's, padding gets no slot and no block, and
            :meth:`memory_stats` counts real tokens only. Without it (or for another attention, which reads K/V
            gathered in transformers' padded layout) rows hold their padding, as transformers' caches do.
        num_kv_heads: KV heads per layer the pool holds; default the config's (a tensor-parallel rank's model holds
            its share: ``hfaccel.kv.local_kv_heads(model)``).
    """

    def __init__(self, config, *, max_batch_size: int, max_cache_len: int | None = None,
                 num_blocks: int | None = None, block_size: int = 16, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, left_padding: Sequence[int] | None = None,
                 num_kv_heads: int | None = None, kv_scales: KVScales = None):
        if max_cache_len is None and num_blocks is None:
            raise ValueError("PagedCache needs max_cache_len or num_blocks")
        if max_batch_size < 1 or block_size < 1:
            raise ValueError(f"max_batch_size and block_size must be >= 1; got {max_batch_size}, {block_size}")
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len if max_cache_len is not None else num_blocks * block_size
        num_blocks = num_blocks or max_batch_size * -(-self._max_cache_len // block_size)
        quantized = dtype in KV_QUANT_DTYPES  # the compute dtype then comes from the first keys written
        super().__init__(config, KVPool(config, num_blocks=num_blocks, block_size=block_size, device=device,
                                        dtype=None if quantized else dtype, num_kv_heads=num_kv_heads,
                                        kv_cache_dtype=dtype if quantized else None, kv_scales=kv_scales))
        self._left_padding: list[int] | None = None
        self.rows: list[int] = []  # the block manager's sequence id of each batch row
        self.padding: list[int] = []  # each row's left padding that the pool does not hold
        self._pads: torch.Tensor | None = None  # [B] int64 device copy of ``padding`` (None: no row has any)
        self.seq_len = 0  # tokens per row (rows of a generate() batch advance together), padding included
        self._next_id = 0
        self._last_layer = -1
        self._step: dict | None = None  # per-forward tensors shared by all layers
        self._tables: torch.Tensor | None = None  # device block tables, reused while no table changes
        self._tables_key: tuple = ()
        self._tables_dirty = True
        if left_padding is not None:
            self.set_left_padding(left_padding)

    def set_left_padding(self, left_padding: Sequence[int]) -> None:
        """Tell the cache each row's left padding before its first forward (see the class's ``left_padding``)."""
        if self.rows:
            raise RuntimeError("PagedCache.set_left_padding must come before the first forward that fills it")
        if any(not 0 <= int(p) for p in left_padding):
            raise ValueError(f"left_padding must be token counts >= 0; got {list(left_padding)}")
        self._left_padding = [int(p) for p in left_padding]

    # --------------------------------------------------------------------------------- transformers API
    def _begin_layer(self, key_states: torch.Tensor, value_states: torch.Tensor,
                     layer_idx: int) -> tuple[PagedKV, torch.Tensor]:
        if layer_idx <= self._last_layer or self._step is None:
            self._begin_forward(key_states.shape[0], key_states.shape[2], key_states)
        self._last_layer = layer_idx
        first_fill = key_states.shape[2] == self.seq_len
        paged = PagedKV(**self.pool.layer_view(layer_idx), block_tables=self._step["block_tables"],
                        seq_lens=self._step["seq_lens"], max_seq_len=self.seq_len - min(self.padding, default=0),
                        dense=(key_states, value_states) if first_fill else None, padding=self._pads,
                        padded_len=self.seq_len)
        return paged, self._step["slot_mapping"]

    # transformers 5.17's Cache defines both as read-only (deprecated) properties; these take their place
    @property
    def max_batch_size(self) -> int:
        """The most rows (batch x beams x return sequences) this cache holds."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        """The most tokens per row."""
        return self._max_cache_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seq_len

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    def reset(self) -> None:
        """Free every row (the pool memory stays allocated for reuse)."""
        self.manager.reset()
        self.rows, self.padding, self._pads, self.seq_len, self._step, self._last_layer = [], [], None, 0, None, -1
        self._tables_dirty = True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens: a negative value removes that many from the end; a positive one is the length to keep."""
        length = self.seq_len + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self.seq_len)
        length = max(length, 0)
        for seq_id, pad in zip(self.rows, self.padding):
            self.manager.crop(seq_id, max(length - pad, 0))
        self.seq_len, self._step, self._tables_dirty = length, None, True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row ``beam_idx[i]``. Block tables and ref-counts move; no K/V is copied."""
        self._reselect([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reselect([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reselect([row for row in range(len(self.rows)) for _ in range(repeats)])

    # ------------------------------------------------------------------------------------------ memory
    def memory_stats(self) -> dict[str, float]:
        """Blocks total/used/free, bytes of the pool, bytes allocated to rows, bytes holding real tokens, waste.
        Padding a row holds (the cache was told the rows' left padding, see ``left_padding``, but the attention
        reads transformers' padded layout) counts as waste; padding the cache was never told of cannot be told
        from tokens and counts as tokens."""
        per_block = self.block_bytes()
        used_tokens = self.manager.num_tokens() - self._held_padding()
        allocated = self.manager.num_used_blocks * per_block
        holding = used_tokens * per_block // self.block_size
        return {
            "blocks_total": self.manager.num_blocks,
            "blocks_used": self.manager.num_used_blocks,
            "blocks_free": self.manager.num_free_blocks,
            "bytes_pool": self.manager.num_blocks * per_block,
            "bytes_allocated": allocated,
            "bytes_holding_tokens": holding,
            "waste_fraction": (allocated - holding) / allocated if allocated else 0.0,
        }

    def _held_padding(self) -> int:
        """Tokens of left padding the rows hold in their blocks (known only when the cache was told them)."""
        if self._left_padding is None or len(self._left_padding) != len(self.rows):
            return 0
        return sum(min(told - skipped, self.seq_len) for told, skipped in zip(self._left_padding, self.padding))

    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.pool.block_bytes()

    def check_request(self, batch_size: int, total_len: int) -> None:
        """Raise ValueError, before any forward pass, if ``batch_size`` rows of ``total_len`` tokens cannot fit."""
        if batch_size > self.max_batch_size:
            raise ValueError(f"PagedCache holds at most max_batch_size={self.max_batch_size} rows; the request "
                             f"needs {batch_size} (batch x beams x return sequences)")
        if total_len > self.max_cache_len:
            raise ValueError(f"the request needs {total_len} tokens per row (prompt + max new tokens) but "
                             f"PagedCache max_cache_len is {self.max_cache_len}")
        padding = self._left_padding if self._left_padding is not None and not self.rows else [0] * batch_size
        needed = sum(self.manager.blocks_needed(max(total_len - pad, 0)) for pad in padding)
        if self.rows:
            needed -= sum(len(self.manager.block_table(s)) for s in self.rows)
        if needed > self.manager.num_free_blocks:
            raise ValueError(f"the request needs {needed} more blocks of {self.block_size} tokens; the pool has "
                             f"{self.manager.num_free_blocks} free of {self.manager.num_blocks}")

    # --------------------------------------------------------------------------------------- internals
    def _begin_forward(self, batch: int, new_tokens: int, like: torch.Tensor) -> None:
        """Reserve slots for this forward's tokens in every row (all or nothing) and build its tensors."""
        if not self.pool.allocated:
            self.pool.allocate(like.device, like.dtype)
        if self.rows and batch != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows but got a batch of {batch}")
        if self.seq_len + new_tokens > self.max_cache_len:
            raise CacheFullError(f"{self.seq_len + new_tokens} tokens per row exceed PagedCache max_cache_len="
                                 f"{self.max_cache_len}")
        if not self.rows:
            self.check_request(batch, new_tokens)
            self.padding = self._first_padding(batch)
            self.rows = [self._new_row(max(new_tokens - pad, 0)) for pad in self.padding]
        else:
            self._append_to_rows(new_tokens)
        start, self.seq_len = self.seq_len, self.seq_len + new_tokens
        tables = self._block_tables()
        positions = torch.arange(start, self.seq_len, device=tables.device)[None]  # [1, S_new]: cache positions
        rows = torch.arange(batch, device=tables.device)[:, None]  # [B, 1]
        seq_lens = torch.full((batch,), self.seq_len, dtype=torch.int32, device=tables.device)
        if self._pads is None and any(self.padding):
            self._pads = torch.tensor(self.padding, dtype=torch.int64).to(tables.device)
        if self._pads is None:
            slots = slot_mapping(tables, rows, positions, self.block_size)  # [B, S_new]
        else:  # a row's token at cache position c is its token c - pad; padding writes nowhere
            held = positions - self._pads[:, None]  # [B, S_new]
            slots = torch.where(held >= 0, slot_mapping(tables, rows, held.clamp(min=0), self.block_size), -1)
            seq_lens = seq_lens - self._pads.to(torch.int32)
        self._step = {"slot_mapping": slots, "block_tables": tables, "seq_lens": seq_lens}

    def _first_padding(self, batch: int) -> list[int]:
        """Each row's left padding the pool will not hold (zeros unless given and read by hfaccel's attention)."""
        if self._left_padding is None or paged_reader_backend(self.config) is None:
            return [0] * batch
        if len(self._left_padding) != batch:
            raise ValueError(f"PagedCache was given left_padding for {len(self._left_padding)} rows; the first "
                             f"forward has {batch}")
        return list(self._left_padding)

    def _block_tables(self) -> torch.Tensor:
        """Device block tables ``[B, max_blocks]`` int32, rebuilt only when some row's table changed."""
        lengths = tuple(len(self.manager.block_table(s)) for s in self.rows)  # tables only grow at their ends
        if self._tables is None or self._tables_dirty or lengths != self._tables_key:
            self._tables = self.pool.block_tables(self.rows).to(self.pool.device)
            self._tables_key, self._tables_dirty = lengths, False
        return self._tables

    def _new_row(self, length: int) -> int:
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.manager.add_sequence(seq_id, num_tokens=length)
        return seq_id

    def _append_to_rows(self, new_tokens: int) -> None:
        needed = self.manager.blocks_to_append_many(self.rows, new_tokens)
        if needed > self.manager.num_free_blocks:
            raise CacheFullError(f"{len(self.rows)} rows need {needed} more blocks for {new_tokens} tokens; the "
                                 f"pool has {self.manager.num_free_blocks} free of {self.manager.num_blocks}")
        copies = [copy for seq_id in self.rows for copy in self.manager.append(seq_id, new_tokens)]
        if copies:
            self._tables_dirty = True
            self.pool.copy_blocks(copies)

    def _reselect(self, sources: list[int]) -> None:
        """New row i continues old row ``sources[i]``: forks share blocks; old rows are then released."""
        if any(not 0 <= s < len(self.rows) for s in sources):
            raise IndexError(f"row indices {sources} out of range for {len(self.rows)} rows")
        if len(sources) > self.max_batch_size:
            raise ValueError(f"{len(sources)} rows exceed PagedCache max_batch_size={self.max_batch_size}")
        old, new = self.rows, []
        for source in sources:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            self.manager.fork(old[source], seq_id)
            new.append(seq_id)
        for seq_id in old:
            self.manager.free(seq_id)
        self.padding = [self.padding[source] for source in sources]
        self.rows, self._step, self._tables_dirty, self._pads = new, None, True, None


class PromptCache(PoolCache):
    """One prefill forward over a left-padded batch ``[B, L]``, its rows' real tokens written into sequences of a
    pool (module docstring): row ``b`` has ``padding[b]`` tokens of padding, which take no slot, and its token at
    cache position ``c`` goes to position ``c - padding[b]`` of sequence ``seq_ids[b]``, which must hold those slots
    already (``KVPool.reserve``, or the engine's scheduler)."""

    def __init__(self, config, pool: KVPool, seq_ids: Sequence[Hashable], padding: Sequence[int]):
        super().__init__(config, pool)
        if len(seq_ids) != len(padding):
            raise ValueError(f"one padding per sequence; got {len(padding)} for {len(seq_ids)} sequences")
        self.seq_ids, self.padding = list(seq_ids), [int(pad) for pad in padding]
        self.seq_len = 0  # cache positions filled (padding included); one forward fills them
        self._view: tuple[PagedKV, torch.Tensor] | None = None  # the forward's view and slots, shared by its layers

    def _begin_layer(self, key_states: torch.Tensor, value_states: torch.Tensor,
                     layer_idx: int) -> tuple[PagedKV, torch.Tensor]:
        batch, _, width, _ = key_states.shape  # [B, Hkv, L, D]
        if self._view is None:
            self._view = self._prefill_view(batch, width, key_states.device)
        paged, slots = self._view
        return replace(paged, **self.pool.layer_view(layer_idx), dense=(key_states, value_states)), slots

    def _prefill_view(self, batch: int, width: int, device: torch.device) -> tuple[PagedKV, torch.Tensor]:
        if batch != len(self.seq_ids) or self.seq_len:
            raise ValueError(f"PromptCache takes one prefill of its {len(self.seq_ids)} sequences; got a forward of "
                             f"{batch} rows" + (" after its prefill" if self.seq_len else ""))
        for seq_id, pad in zip(self.seq_ids, self.padding):
            if self.manager.seq_len(seq_id) < width - pad:
                raise ValueError(f"sequence {seq_id!r} holds {self.manager.seq_len(seq_id)} slots; its prompt has "
                                 f"{width - pad} tokens")
        tables = self.pool.block_tables(self.seq_ids).to(device)  # [B, W]
        pads = torch.tensor(self.padding, dtype=torch.int64).to(device)  # [B]
        held = torch.arange(width, device=device)[None] - pads[:, None]  # [B, L]: position in the sequence
        rows = torch.arange(batch, device=device)[:, None]
        slots = torch.where(held >= 0, slot_mapping(tables, rows, held.clamp(min=0), self.block_size), -1)
        self.seq_len = width
        paged = PagedKV(**self.pool.layer_view(0), block_tables=tables, seq_lens=(width - pads).to(torch.int32),
                        max_seq_len=width - min(self.padding), padding=pads if any(self.padding) else None,
                        padded_len=width)
        return paged, slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # the masks are made before the first layer: the keys are the prompt's
        return (self.seq_len + query_length if self._view is None else self.seq_len), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False


class SequenceKVCache(PoolCache):
    """A ``transformers.Cache`` holding many independent sequences of one pool, for packed forwards.

    The runner sets ``step`` (a device :class:`PackedStep`) before the model's forward; the model's layers then
    call ``update`` with their packed K/V ``[1, Hkv, T, D]``. The model's attention must read the pool
    (hfaccel's attention: the runner checks it before each forward).
    """

    def __init__(self, config, pool: KVPool):
        super().__init__(config, pool)
        self.step: PackedStep | None = None
        # the recurrent layers' per-group states, handed to their mixers (a model with recurrent state)
        self.state_view = StateView(pool.num_layers) if pool.states is not None else None

    @property
    def states_step(self) -> StateStep | None:
        """This forward's state slots and groups (None without recurrent state, or outside a forward)."""
        return None if self.step is None else self.step.state

    def _begin_layer(self, key_states: torch.Tensor, value_states: torch.Tensor,
                     layer_idx: int) -> tuple[PagedKV, torch.Tensor]:
        step = self.step
        if step is None:
            raise RuntimeError("SequenceKVCache.step must be set (by the runner) before the model's forward")
        # one sequence computing its whole prompt: its new K/V are all its keys (attention may read them densely);
        # the static lengths are compared first, so a compiled decode step never branches on its batch size
        fresh = step.max_seq_len == step.max_q_len and step.cu_seqlens_q.shape[0] == 2
        held = self.pool.layout.attention[layer_idx]
        paged = PagedKV(**self.pool.layer_view(layer_idx), block_tables=step.block_tables, seq_lens=step.seq_lens,
                        max_seq_len=step.max_seq_len, dense=(key_states, value_states) if fresh else None,
                        cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=step.max_q_len, window=held.window,
                        chunk=held.chunk)
        return paged, step.slot_mapping

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: packed sequences have no one length (each token's position is in ``position_ids``); a module that
        reads one anyway is bounded where that is exact (``hfaccel.runner.runner.packed_token_limit``)."""
        return 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return (0 if self.step is None else self.step.max_seq_len), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False


def sequence_cache(model, pool: KVPool) -> SequenceKVCache:
    """The runner's :class:`SequenceKVCache` for ``model``: also an instance of the cache class the model's forward
    insists on, where it has one (``hfaccel.kv.layout.own_cache_class``: MiniMax's), whose state the mixers reach
    through hfaccel's state slots instead (``hfaccel.kv.state``)."""
    own = own_cache_class(model)
    return (SequenceKVCache if own is None else _sequence_cache_class(own))(model.config, pool)


@functools.cache
def _sequence_cache_class(own: type) -> type[SequenceKVCache]:
    def __init__(self, config, pool: KVPool):
        SequenceKVCache.__init__(self, config, pool)
        self.linear_cache = []  # what the own class's methods read; the mixers never write it (they get a StateView)

    return type(f"SequenceKVCache_{own.__name__}", (SequenceKVCache, own), {"__init__": __init__})
