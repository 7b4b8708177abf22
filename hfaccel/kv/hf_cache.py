"""transformers ``Cache`` views over a :class:`~hfaccel.kv.pool.KVPool`: :class:`PoolCache`, their one base, and

- :class:`~hfaccel.kv.paged_cache.PagedCache`, for ``generate`` (``hfaccel.kv.paged_cache``): each batch row one
  sequence of the pool, blocks allocated as tokens arrive.
- :class:`PromptCache`, for a prompt's prefill through the model's own forward (a multimodal one's: its images
  encoded and merged as transformers does it) into sequences of a pool whose slots are reserved: a left-padded batch,
  row ``b``'s real tokens written to sequence ``seq_ids[b]`` from position 0, or after the ``past`` tokens its
  sequences hold already (prefix-cache hits).
- :class:`SequenceKVCache`, for hfaccel's :class:`~hfaccel.runner.ModelRunner`: any number of independent
  sequences packed into one ``[1, T]`` row; the runner sets each forward's metadata (``step``).

Each writes new K/V into the pool by slot mapping (``hfaccel.kernels.write_kv``). What a layer's ``update``
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
from hfaccel.kernels.write_kv import dequantize_kv
from hfaccel.kv.block_manager import BlockManager, slot_mapping
from hfaccel.kv.latent import LatentHeads
from hfaccel.kv.layout import AttentionKV, indexer_columns, joined_latents, own_cache_class
from hfaccel.kv.pool import KVPool, PackedStep
from hfaccel.kv.state import StateStep, StateView

# An attention function that reads PagedKV carries this attribute; its value is the kernel backend ("auto",
# "triton" or "torch") the cache then also writes with.
PAGED_READER_ATTRIBUTE = "hfaccel_kernel_backend"
# The keyword argument through which a packed forward of a model whose layers expand latents (MLA) hands its
# ``PackedStep`` to hfaccel's attention (transformers passes a forward's keyword arguments on to the attention
# function, as its flash-attention varlen arguments): such a layer's cache returns each sequence's latents, which
# the module expands before its attention call, so no ``PagedKV`` reaches the attention to say how they are packed.
PACKED_STEP_KWARG = "hfaccel_packed_step"


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
    positions: torch.Tensor | None = None  # [T] int64: each packed query's position in its sequence
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
    # a latent layer read in the latent space (``hfaccel.kv.latent``): how its module expands the latents; the
    # attention reads each token's two latents as one row (``paged_attention_op(joined=True)``)
    latent: LatentHeads | None = None

    def to(self, device: torch.device | str, *args, **kwargs) -> PagedKV:
        """Itself, on the pool's device: a layer that reads another layer's K/V moves them to its own device first
        (Gemma 4's shared layers, transformers 5.17), and hfaccel serves a model on one device."""
        device = torch.device(device)
        held = self.kv_cache.device
        if device.type != held.type or device.index not in (None, held.index):
            raise ValueError(f"hfaccel's KV pool lives on {held}; a layer asked for its K/V on {device}")
        return self

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values ``[B, Hkv, S, D]`` (for attention paths that need them contiguous, and for layers
        that expand their latents: a quantized pool's dequantized). Packed sequences (``cu_seqlens_q``) are rows of
        their own, each from its first token, the longest's length."""
        if self.dense is not None:
            return self.dense
        keys, values = self.gather_rows(slice(0, 2), slice(None))
        return keys, values

    def gather_rows(self, parts: slice, columns: slice) -> tuple[torch.Tensor, ...]:
        """The pool's rows of ``parts`` (``slice(0, 2)``: keys and values; ``slice(1, 2)``: values), their
        ``columns`` only, each ``[B, Hkv, S, D]`` laid out as :meth:`gather` lays them out (never the forward's
        ``dense`` K/V), dequantized. Only those columns are read."""
        pools = self.kv_cache[self.layer][parts, ..., columns]  # [P, num_blocks, block_size, Hkv, D]: a view
        size = pools.shape[2]
        if self.padding is not None:  # transformers' layout: cache position c of row b, zeros for its padding
            held = torch.arange(self.padded_len, device=self.padding.device)[None] - self.padding[:, None]  # [B, S]
            rows = torch.arange(held.shape[0], device=held.device)[:, None]
            slots = slot_mapping(self.block_tables, rows, held.clamp(min=0), size)  # [B, S]
            flat = self._dequantized(pools.flatten(1, 2)[:, slots], parts)  # [P, B, S, Hkv, D]
            flat = flat * (held >= 0)[None, :, :, None, None]
        else:
            length = self.max_seq_len
            blocks = self.block_tables[:, : -(-length // size)]  # [B, n_blocks]
            picked = pools.index_select(1, blocks.flatten().long())  # [P, B * n_blocks, block_size, Hkv, D]
            flat = picked.view(pools.shape[0], blocks.shape[0], -1, *pools.shape[3:])[
                :, :, :length
            ]  # [P, B, S, Hkv, D]
            flat = self._dequantized(flat, parts)
        return tuple(part.transpose(1, 2) for part in flat)

    def _dequantized(self, stored: torch.Tensor, parts: slice) -> torch.Tensor:
        """``stored [P, ..., Hkv, D]`` rows of the pool's ``parts`` in the dtype reads return (a quantized pool's
        times its scales)."""
        if self.kv_scales is None:
            return stored
        scales = self.kv_scales[self.layer, parts]  # [P, Hkv]
        return torch.stack([dequantize_kv(rows, scale, self.dtype) for rows, scale in zip(stored, scales)])


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
        # an indexed layer's latents of this forward, their view and slots, until its indexer keys join them
        self._unindexed: dict[int, tuple[torch.Tensor, torch.Tensor, PagedKV, torch.Tensor]] = {}
        # what follows the packed rows token by token (the runner's LoRA context): told the rows of each recurrent
        # mixer call (hfaccel.kv.state)
        self.row_followers: tuple = ()

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
        keys, values = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [B, S_new, Hkv, D]
        held = self.pool.layout.attention[layer_idx]
        self.pool.write(layer_idx, keys, values, slots, backend=backend or "auto", calibrate=not held.indexer_dim)
        if held.indexer_dim:  # its indexer's keys follow (update_indexer), written into the same rows
            self._unindexed[layer_idx] = (keys, values, paged, slots)
        if held.latent:  # its module expands the latents it reads back (MLA)
            return self._latents(paged, held, layer_idx)
        if backend is not None:
            return paged, paged
        return paged.gather()

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store a sparse-attention layer's indexer keys ``[B, S_new, D]`` with the latents its ``update`` took this
        forward (each token's row rewritten whole); every held token's, ``[B, S, D]`` in transformers' layout."""
        held = self.pool.layout.attention.get(layer_idx)
        if held is None or not held.indexer_dim or layer_idx not in self._unindexed:
            raise RuntimeError(
                f"layer {layer_idx}'s indexer keys come after its latents (update) in one forward, on a layer whose "
                "layout holds them"
            )
        paged = self._unindexed[layer_idx][2]
        self.store_indexer_keys(layer_idx, indexer_keys.flatten(0, 1))
        del self._unindexed[layer_idx]
        return self._indexer_keys(paged, held)

    def store_indexer_keys(
        self, layer_idx: int, indexer_keys: torch.Tensor, tokens: torch.Tensor | None = None, calibrate: bool = True
    ) -> None:
        """Store indexer keys ``[N, D]`` of this forward's new tokens ``tokens [N]`` (indices into its ``[B * S_new]``
        new tokens; None: all of them) with the latents the layer's ``update`` took for them (each row rewritten;
        ``calibrate``: as :meth:`KVPool.write` takes it)."""
        keys, values, _, slots = self._unindexed[layer_idx]  # [B, S_new, 1, key | value], [B, S_new]
        keys, values, slots = keys.flatten(0, 1), values.flatten(0, 1), slots.flatten()
        if tokens is not None:
            keys, values, slots = keys[tokens], values[tokens], slots[tokens]
        values = torch.cat([values, indexer_keys[:, None].to(values.dtype)], dim=-1)  # [N, 1, value + D]
        backend = paged_reader_backend(self.config) or "auto"
        self.pool.write(layer_idx, keys[None], values[None], slots[None], backend=backend, calibrate=calibrate)

    def _indexer_keys(self, paged: PagedKV, held: AttentionKV) -> torch.Tensor:
        """A sparse-attention layer's every held indexer key, ``[B, S, D]`` in transformers' layout: the columns of
        the value rows that hold them (``hfaccel.kv.layout.indexer_columns``)."""
        (keys,) = paged.gather_rows(slice(1, 2), indexer_columns(held))  # [B, 1, S, D]
        return keys[:, 0]

    def _latents(self, paged: PagedKV, held: AttentionKV, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A latent layer's every held token, ``[B, Hkv, S, key_dim]`` and ``[B, Hkv, S, value_dim]``, in
        transformers' layout."""
        return joined_latents(*paged.gather(), held)

    def _begin_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[PagedKV, torch.Tensor]:
        """The layer's view for this forward, and the slots ``[B, S_new]`` its new tokens go to."""
        raise NotImplementedError


class PromptCache(PoolCache):
    """One prefill forward over a left-padded batch ``[B, L]``, its rows' real tokens written into sequences of a
    pool (module docstring): row ``b`` has ``padding[b]`` tokens of padding, which take no slot, and its token at
    cache position ``c`` goes to position ``c - padding[b]`` of sequence ``seq_ids[b]``, which must hold those slots
    already (``KVPool.reserve``, or the engine's scheduler). ``block_tables [B, W]``: the sequences' blocks as given
    (a tensor-parallel follower's, whose pool holds no sequences: the leader's tables come with its steps), instead
    of those the pool's block manager holds for ``seq_ids``. ``past``: the tokens each sequence holds already (no
    padding then): the forward's tokens continue after them, and attend to them."""

    def __init__(
        self,
        config,
        pool: KVPool,
        seq_ids: Sequence[Hashable],
        padding: Sequence[int],
        block_tables: torch.Tensor | None = None,
        past: int = 0,
    ):
        super().__init__(config, pool)
        if len(seq_ids) != len(padding):
            raise ValueError(f"one padding per sequence; got {len(padding)} for {len(seq_ids)} sequences")
        if past < 0 or past and (any(padding) or pool.states is not None):
            raise ValueError(
                f"a prefill after {past} tokens held takes rows without padding, of a model without recurrent state; "
                f"got padding {list(padding)}" + (" and recurrent state" if pool.states is not None else "")
            )
        if block_tables is not None and (block_tables.dim() != 2 or block_tables.shape[0] != len(seq_ids)):
            raise ValueError(
                f"block_tables must be [B, W] with B = {len(seq_ids)} sequences; got {tuple(block_tables.shape)}"
            )
        if block_tables is not None and pool.states is not None:
            raise ValueError("given block tables carry no state slots: a model with recurrent state needs its pool's")
        self.seq_ids, self.padding = list(seq_ids), [int(pad) for pad in padding]
        self.block_tables = block_tables
        self.past = past
        self.seq_len = past  # cache positions filled (padding included); one forward fills the rest
        self._view: tuple[PagedKV, torch.Tensor] | None = None  # the forward's view and slots, shared by its layers
        # a hybrid model's recurrent layers: each row's state starts here and goes to its sequence's slot
        self.state_view = StateView(pool.num_layers) if pool.states is not None else None

    @functools.cached_property
    def prompt_state_slots(self) -> torch.Tensor | None:
        """The state slot of each row's sequence, ``[B]`` int64 on the pool's device (None without recurrent
        state): the recurrent layers run transformers' own forward on the padded batch and store each row's state
        there (``hfaccel.kv.state``)."""
        if self.pool.states is None:
            return None
        slots = [self.manager.state_slot(seq_id) for seq_id in self.seq_ids]
        return torch.tensor(slots, dtype=torch.int64).to(self.pool.device)

    def _begin_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[PagedKV, torch.Tensor]:
        batch, _, width, _ = key_states.shape  # [B, Hkv, L, D]
        if self._view is None:
            self._view = self._prefill_view(batch, width, key_states.device)
        paged, slots = self._view
        dense = None if self.past else (key_states, value_states)  # the new K/V are all the keys without a past
        return replace(paged, **self.pool.layer_view(layer_idx), dense=dense), slots

    def _slots_held(self) -> list[int]:
        """The slots each sequence holds: its block manager's count, or its given table's whole blocks."""
        if self.block_tables is None:
            return [self.manager.seq_len(seq_id) for seq_id in self.seq_ids]
        return [self.block_tables.shape[1] * self.block_size] * len(self.seq_ids)

    def _prefill_view(self, batch: int, width: int, device: torch.device) -> tuple[PagedKV, torch.Tensor]:
        if batch != len(self.seq_ids):
            raise ValueError(
                f"PromptCache takes one prefill of its {len(self.seq_ids)} sequences; got a forward of {batch} rows"
            )
        past = self.past
        for seq_id, pad, held in zip(self.seq_ids, self.padding, self._slots_held()):
            if held < past + width - pad:
                holder = f"sequence {seq_id!r}" if self.block_tables is None else "the given block table"
                raise ValueError(f"{holder} holds {held} slots; its prompt has {past + width - pad} tokens")
        tables = self.block_tables if self.block_tables is not None else self.pool.block_tables(self.seq_ids)
        tables = tables.to(device)  # [B, W]
        pads = torch.tensor(self.padding, dtype=torch.int64).to(device)  # [B]
        held = torch.arange(past, past + width, device=device)[None] - pads[:, None]  # [B, L]: position in the sequence
        rows = torch.arange(batch, device=device)[:, None]
        slots = torch.where(held >= 0, slot_mapping(tables, rows, held.clamp(min=0), self.block_size), -1)
        self.seq_len = past + width
        paged = PagedKV(
            **self.pool.layer_view(min(self.pool.place)),  # a template: each layer's view replaces its own fields
            block_tables=tables,
            seq_lens=(past + width - pads).to(torch.int32),
            max_seq_len=past + width - min(self.padding),
            padding=pads if any(self.padding) else None,
            padded_len=width,
        )
        return paged, slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # the masks are made before the first layer: the keys are the prompt's
        return (self.seq_len + query_length if self._view is None else self.seq_len), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past  # the forward's queries follow the tokens held before it

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
        self._step: PackedStep | None = None
        self.per_step: dict = {}  # what a forward's modules work out once for it (hfaccel.kv.indexer's groups)
        self.absorbed: dict[int, LatentHeads] = {}  # latent layers read in the latent space (the runner's choice)
        # the recurrent layers' per-group states, handed to their mixers (a model with recurrent state)
        self.state_view = StateView(pool.num_layers) if pool.states is not None else None

    @property
    def step(self) -> PackedStep | None:
        """This forward's metadata (None outside a forward)."""
        return self._step

    @step.setter
    def step(self, step: PackedStep | None) -> None:
        self._step, self.per_step = step, {}

    @property
    def states_step(self) -> StateStep | None:
        """This forward's state slots and groups (None without recurrent state, or outside a forward)."""
        return None if self.step is None else self.step.state

    def _begin_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[PagedKV, torch.Tensor]:
        step = self.step
        if step is None:
            raise RuntimeError("SequenceKVCache.step must be set (by the runner) before the model's forward")
        # one sequence computing its whole prompt: its new K/V are all its keys (attention may read them densely);
        # the static lengths are compared first, so a compiled decode step never branches on its batch size
        fresh = step.max_seq_len == step.max_q_len and step.cu_seqlens_q.shape[0] == 2
        held = self.pool.layout.attention[layer_idx]
        paged = PagedKV(
            **self.pool.layer_view(layer_idx),
            block_tables=step.block_tables,
            seq_lens=step.seq_lens,
            max_seq_len=step.max_seq_len,
            dense=(key_states, value_states) if fresh else None,
            cu_seqlens_q=step.cu_seqlens_q,
            max_seqlen_q=step.max_q_len,
            positions=step.positions,
            window=held.window,
            chunk=held.chunk,
        )
        return paged, step.slot_mapping

    def _latents(self, paged: PagedKV, held: AttentionKV, layer_idx: int):
        """An absorbed layer's view of the pool, twice (``hfaccel.kv.latent``: its ``expand_kv`` passes it on),
        but on one prompt's whole prefill; else the layer's packed sequences, one after another in one row:
        ``[1, Hkv, S * L, D]``, sequence ``s``'s tokens from ``s * L`` on (``L`` the step's ``max_seq_len``), so that
        the module expands them as one batch row whatever the number of sequences (hfaccel's attention reads them
        with the step: ``PACKED_STEP_KWARG``)."""
        heads = self.absorbed.get(layer_idx)
        if heads is not None and paged.dense is None:
            latent = replace(paged, latent=heads)
            return latent, latent
        return tuple(t.transpose(0, 1).flatten(1, 2)[None] for t in super()._latents(paged, held, layer_idx))

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise RuntimeError(
            "a packed forward runs each sparse-attention indexer per group of its sequences "
            "(hfaccel.kv.indexer.install_indexers), whose own view stores the indexer keys"
        )

    def indexer_keys(self, layer_idx: int, sequences: torch.Tensor, held: int) -> torch.Tensor:
        """The indexer keys the forward's ``sequences [G]`` hold, ``[G, held, D]`` (each from its first token;
        ``held`` at least the longest's count)."""
        paged = self._unindexed[layer_idx][2]
        view = replace(paged, block_tables=paged.block_tables[sequences], max_seq_len=held)
        return self._indexer_keys(view, self.pool.layout.attention[layer_idx])

    def end_indexer(self, layer_idx: int, indexer_keys: torch.Tensor | None) -> None:
        """The layer's indexer keys of this forward, ``[T, D]``, are all stored (by groups, without setting an fp8
        pool's scales: a pool that takes them from its first prefill takes them from every row, all rewritten);
        None: the forward ended before they were (the next one rewrites its rows)."""
        if indexer_keys is not None and self.pool.calibrating(layer_idx):
            self.store_indexer_keys(layer_idx, indexer_keys)
        del self._unindexed[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: packed sequences have no one length (each token's position is in ``position_ids``, and in
        :attr:`PagedKV.positions` for the attention); a module that reads one anyway is bounded where that is exact
        (``hfaccel.runner.runner.packed_token_limit``)."""
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


def packed_sequences(cu_seqlens_q: torch.Tensor, tokens: int) -> torch.Tensor:
    """The sequence of each of a packed forward's ``tokens`` queries, ``[T]`` int64 (``cu_seqlens_q [S + 1]``; no
    host read)."""
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [S]
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=tokens)


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
