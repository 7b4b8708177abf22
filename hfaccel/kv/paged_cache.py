"""``PagedCache``: the transformers ``Cache`` for ``generate`` over a :class:`~hfaccel.kv.pool.KVPool`, usable by any
model (``model.generate(..., cache=PagedCache(model.config, max_batch_size=B, max_cache_len=L))``,
``past_key_values=`` before transformers 5.24). Each batch row is one sequence of the pool, blocks are allocated as
tokens arrive; beam search and batch selection fork rows' blocks instead of copying K/V. What its layers return is
:class:`~hfaccel.kv.hf_cache.PoolCache`'s (``hfaccel.kv.hf_cache``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hfaccel.kernels.write_kv import KV_QUANT_DTYPES
from hfaccel.kv.block_manager import CacheFullError, slot_mapping
from hfaccel.kv.fp8 import KVScales
from hfaccel.kv.hf_cache import PagedKV, PoolCache, paged_reader_backend
from hfaccel.kv.pool import KVPool


class PagedCache(PoolCache):
    """Paged KV cache for ``generate`` (module docstring).

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

    def __init__(
        self,
        config,
        *,
        max_batch_size: int,
        max_cache_len: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        left_padding: Sequence[int] | None = None,
        num_kv_heads: int | None = None,
        kv_scales: KVScales = None,
    ):
        if max_cache_len is None and num_blocks is None:
            raise ValueError("PagedCache needs max_cache_len or num_blocks")
        if max_batch_size < 1 or block_size < 1:
            raise ValueError(f"max_batch_size and block_size must be >= 1; got {max_batch_size}, {block_size}")
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len if max_cache_len is not None else num_blocks * block_size
        num_blocks = num_blocks or max_batch_size * -(-self._max_cache_len // block_size)
        quantized = dtype in KV_QUANT_DTYPES  # the compute dtype then comes from the first keys written
        super().__init__(
            config,
            KVPool(
                config,
                num_blocks=num_blocks,
                block_size=block_size,
                device=device,
                dtype=None if quantized else dtype,
                num_kv_heads=num_kv_heads,
                kv_cache_dtype=dtype if quantized else None,
                kv_scales=kv_scales,
            ),
        )
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
    def _begin_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[PagedKV, torch.Tensor]:
        if layer_idx <= self._last_layer or self._step is None:
            self._begin_forward(key_states.shape[0], key_states.shape[2], key_states)
        self._last_layer = layer_idx
        first_fill = key_states.shape[2] == self.seq_len
        paged = PagedKV(
            **self.pool.layer_view(layer_idx),
            block_tables=self._step["block_tables"],
            seq_lens=self._step["seq_lens"],
            max_seq_len=self.seq_len - min(self.padding, default=0),
            dense=(key_states, value_states) if first_fill else None,
            padding=self._pads,
            padded_len=self.seq_len,
        )
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
    def memory_stats(self) -> dict[str, float | str | None]:
        """Blocks total/used/free, bytes of the pool, bytes allocated to rows, bytes holding real tokens, waste, and
        the dtype K/V are stored in (``kv_cache_dtype``, as ``Engine.stats()`` says it: ``"torch.float8_e4m3fn"`` for
        an fp8 pool; None while a pool taking the first keys' dtype has none yet). Padding a row holds (the cache was
        told the rows' left padding, see ``left_padding``, but the attention reads transformers' padded layout)
        counts as waste; padding the cache was never told of cannot be told from tokens and counts as tokens."""
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
            "kv_cache_dtype": None if self.pool.cache_dtype is None else str(self.pool.cache_dtype),
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
            raise ValueError(
                f"PagedCache holds at most max_batch_size={self.max_batch_size} rows; the request "
                f"needs {batch_size} (batch x beams x return sequences)"
            )
        if total_len > self.max_cache_len:
            raise ValueError(
                f"the request needs {total_len} tokens per row (prompt + max new tokens) but "
                f"PagedCache max_cache_len is {self.max_cache_len}"
            )
        padding = self._left_padding if self._left_padding is not None and not self.rows else [0] * batch_size
        needed = sum(self.manager.blocks_needed(max(total_len - pad, 0)) for pad in padding)
        if self.rows:
            needed -= sum(len(self.manager.block_table(s)) for s in self.rows)
        if needed > self.manager.num_free_blocks:
            raise ValueError(
                f"the request needs {needed} more blocks of {self.block_size} tokens; the pool has "
                f"{self.manager.num_free_blocks} free of {self.manager.num_blocks}"
            )

    # --------------------------------------------------------------------------------------- internals
    def _begin_forward(self, batch: int, new_tokens: int, like: torch.Tensor) -> None:
        """Reserve slots for this forward's tokens in every row (all or nothing: keys the pool cannot take reserve
        none) and build its tensors."""
        if not self.pool.allocated:
            self.pool.allocate_like(like)
        self.pool.check_takes(like.dtype)
        if self.rows and batch != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows but got a batch of {batch}")
        if self.seq_len + new_tokens > self.max_cache_len:
            raise CacheFullError(
                f"{self.seq_len + new_tokens} tokens per row exceed PagedCache max_cache_len={self.max_cache_len}"
            )
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
            raise ValueError(
                f"PagedCache was given left_padding for {len(self._left_padding)} rows; the first forward has {batch}"
            )
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
            raise CacheFullError(
                f"{len(self.rows)} rows need {needed} more blocks for {new_tokens} tokens; the "
                f"pool has {self.manager.num_free_blocks} free of {self.manager.num_blocks}"
            )
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
