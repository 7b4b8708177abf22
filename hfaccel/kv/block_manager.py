"""The block manager of the paged KV pool (plain Python bookkeeping), and the slot arithmetic.

The KV pool is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a block table (its
blocks in order) and a length; token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size`` (:func:`slot_mapping`, the one place that says so).

Invariants (checked by ``check_invariants`` and property-tested):

- a block's ref-count is the number of live sequences whose table holds it; a block with ref-count 0 is in
  the free pool, and every block is either free or referenced;
- a sequence writes only into the last block of its table, and only when it holds that block alone: a
  shared last block is first copied (copy-on-write; the copy is returned to the caller to perform on the
  device), so two live sequences never write the same block;
- with prefix caching (:mod:`hfaccel.kv.prefix_cache`), each full block whose tokens are known and whose K/V have
  been computed is registered under its key; a sequence whose prompt starts with registered full blocks under the
  same salts reuses them (ref-count + 1) instead of allocating. Freed blocks keep their content and registration
  until the pool reuses them, so a later request can still hit them. A registered block never changes under its
  key: a sequence cropped into a registered block keeps the registration until it writes there, and then either
  unregisters the block (held alone) or copies it first (shared). A caller that computes a sequence's K/V later than
  it allocates them (the engine's chunked prefill) passes ``computed=False`` and reports progress with
  ``mark_computed``, so no other sequence can hit a block before its K/V are written.
- with ``state_slots`` (a model whose layers keep recurrent state beside K/V), every live sequence also holds one
  state slot of its own: taken with its first blocks, given back when it is freed; a fork takes a new slot whose
  state is copied from the parent's (:meth:`BlockManager.take_state_copies`, performed by the pool before the next
  forward). Such a state cannot be rolled back or shared, so these managers neither crop nor share prefixes.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from hfaccel.kv.prefix_cache import PrefixCache, Salts, Spans


def slot_mapping(
    block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Pool slot (int64) of token ``positions`` of the sequences whose block tables are ``block_tables[rows]``.

    ``block_tables [S, W]``; ``rows`` and ``positions`` are index tensors of one (broadcastable) shape, e.g.
    ``rows [T]`` and ``positions [T]`` for packed tokens, or ``rows [B, 1]`` and ``positions [1, S]`` for a batch.
    """
    return block_tables[rows, positions // block_size].long() * block_size + positions % block_size


class CacheFullError(RuntimeError):
    """The pool has too few free blocks for a request; nothing was changed."""


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] | None = None  # known token ids (prefix caching); None when unknown
    hashes: list[int] = field(default_factory=list)  # hashes of this sequence's leading full blocks
    computed: int = 0  # leading tokens whose K/V are in the pool (only those blocks may be registered)
    epoch: int = 0  # changes whenever an entry of ``blocks`` is replaced or removed (not when blocks are appended)
    salt: Hashable = None  # what the first block's hash is chained to (prefix caching): None, or a LoRA adapter's key
    salts_from: Salts = ()  # (token, salt): mixed into the key of the block holding that token


@dataclass(frozen=True)
class PrefixHit:
    """What :meth:`BlockManager.add_sequence` would find for a prompt now: its first ``tokens`` tokens in the prefix
    cache, and the ``free_blocks`` it would take (new blocks after the hit, and the hit's cached blocks that no
    sequence holds); ``blocks`` holding the hit, and their keys' ``hashes`` (``add_sequence`` takes them without
    hashing the prompt again)."""

    tokens: int
    free_blocks: int
    blocks: tuple[int, ...] = ()
    hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src`` into block ``dst`` (every layer, K and V) before writing to ``dst``."""

    src: int
    dst: int


class BlockManager:
    """Allocates pool blocks to sequences: on demand, ref-counted, with fork, crop and prefix sharing."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True, state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks} and {block_size}")
        if state_slots < 0 or state_slots and enable_prefix_caching:
            raise ValueError(
                f"state_slots must be >= 0 and excludes prefix caching (a recurrent state cannot be "
                f"shared by prefix); got state_slots={state_slots}, "
                f"enable_prefix_caching={enable_prefix_caching}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self._seqs: dict[Hashable, _Sequence] = {}
        self.prefix_cache = PrefixCache(block_size)
        self.peak_used_blocks = 0  # the most blocks in use at once (set back with ``peak_used_blocks = 0``)
        self._epochs = itertools.count(1)  # table epochs, never reused: a sequence id used again gets a new one
        self.state_slots = state_slots
        self._free_states = list(range(state_slots - 1, -1, -1))  # slot 0 taken first
        self._state_of: dict[Hashable, int] = {}
        self._state_copies: list[BlockCopy] = []  # forks' state copies (src slot -> dst slot) not performed yet

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def stats(self) -> dict[str, int | str]:
        """Blocks now (total, used, free), whether prefix caching is on, and state slots where the model keeps state."""
        prefix = (
            "on"
            if self.enable_prefix_caching
            else (
                "off (the model's layers keep recurrent state, which is not kept per block)"
                if self.state_slots
                else "off"
            )
        )
        stats = {
            "blocks_total": self.num_blocks,
            "blocks_used": self.num_used_blocks,
            "blocks_free": self.num_free_blocks,
            "prefix_caching": prefix,
        }
        if self.state_slots:  # a hybrid model: one slot of recurrent state per running sequence
            stats.update(state_slots=self.state_slots, state_slots_free=self.num_free_state_slots)
        return stats

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> list[Hashable]:
        return list(self._seqs)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._get(seq_id).blocks

    def seq_len(self, seq_id: Hashable) -> int:
        return self._get(seq_id).length

    def state_slot(self, seq_id: Hashable) -> int:
        """The state slot of a sequence (managers with ``state_slots``)."""
        self._get(seq_id)
        return self._state_of[seq_id]

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_states)

    def take_state_copies(self) -> list[BlockCopy]:
        """The forks' state copies (slot ``src`` into slot ``dst``) to perform before the next forward; cleared."""
        copies, self._state_copies = self._state_copies, []
        return copies

    def table_epoch(self, seq_id: Hashable) -> int:
        """A number that changes whenever an entry of the sequence's block table is replaced or removed (a new
        sequence, a copy-on-write, a crop that frees blocks) and stays while blocks are only appended: a copy of the
        table made at the same epoch is a prefix of the table (``hfaccel.kv.device_tables.DeviceBlockTables``)."""
        return self._get(seq_id).epoch

    def num_tokens(self) -> int:
        """Token slots in use, counting a block shared by several sequences once."""
        used = {}
        for seq in self._seqs.values():
            for index, block in enumerate(seq.blocks):
                filled = min(self.block_size, seq.length - index * self.block_size)
                used[block] = max(used.get(block, 0), filled)
        return sum(used.values())

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Pool slot of each token position in ``[start, end)`` of the sequence."""
        table = torch.tensor([self._get(seq_id).blocks or [0]], dtype=torch.int64)  # [1, W]
        positions = torch.arange(start, end)
        return slot_mapping(table, torch.zeros_like(positions), positions, self.block_size).tolist()

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    def blocks_to_append_many(self, seq_ids: Sequence[Hashable], num_tokens: int) -> int:
        """Free blocks that appending ``num_tokens`` to each of ``seq_ids`` in turn takes. A shared partial last
        block held only by these sequences is copied by all of them but the last, which keeps it."""
        total = sum(self.blocks_to_append(seq_id, num_tokens) for seq_id in seq_ids)
        if num_tokens == 0:
            return total
        seqs = [self._get(seq_id) for seq_id in seq_ids]
        holders = Counter(seq.blocks[-1] for seq in seqs if seq.length % self.block_size)
        return total - sum(1 for block, count in holders.items() if count > 1 and self.ref_counts[block] == count)

    def prefix_hit(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: Hashable = None,
        salts_from: Salts = (),
        unsplit: Spans = (),
    ) -> PrefixHit:
        """What ``add_sequence`` with the same arguments would find and take now, changing nothing: no block is taken
        or evicted."""
        _, _, hit = self._lookup(token_ids, num_tokens, salt, salts_from, unsplit)
        return hit

    # ----------------------------------------------------------------------------------------- changes
    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] | None = None,
        *,
        num_tokens: int | None = None,
        computed: bool = True,
        salt: Hashable = None,
        salts_from: Salts = (),
        unsplit: Spans = (),
        hit: PrefixHit | None = None,
    ) -> int:
        """Start a sequence holding a prompt; returns how many leading tokens were found in the prefix cache.

        Give ``token_ids`` (enables prefix sharing) or just ``num_tokens``. Blocks for the whole prompt are
        allocated (reused where a prefix hit). ``computed=False``: the prompt's K/V (past the prefix hit) are
        not written yet (see ``mark_computed``). Raises ``CacheFullError`` with nothing changed if the pool
        cannot hold it. ``salt``: what else the K/V depend on besides the tokens (a LoRA adapter's
        ``cache_key``): only blocks registered under the same salt are shared. ``salts_from``: ``(token, salt)``
        pairs, what else the K/V from ``token`` on depend on (a prompt's images): the blocks before the one holding it
        are keyed without it. ``unsplit``: token spans ``(start, end)`` a hit must not end inside (a prompt's images,
        each computed whole): a hit that would is cut back to the block boundary at or before the span's start.
        ``hit``: what :meth:`prefix_hit` found for the same arguments, taken as found while its blocks are still
        registered under their keys (else the prompt is looked up again).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        hits, hashes, hit = self._lookup(token_ids, num_tokens, salt, salts_from, unsplit, hit)
        length = _length(token_ids, num_tokens)
        if hit.free_blocks > self.num_free_blocks:
            raise CacheFullError(
                f"sequence of {length} tokens needs {hit.free_blocks} free blocks of {self.block_size} slots "
                f"({hit.tokens} tokens found in the prefix cache); the pool has {self.num_free_blocks} "
                f"(of {self.num_blocks})"
            )
        self._check_state_slot()
        seq = _Sequence(epoch=next(self._epochs), salt=salt, salts_from=salts_from)
        for block in hits:
            self._ref(block)
        seq.blocks, seq.hashes = list(hits), hashes
        seq.blocks += [self._allocate() for _ in range(self.blocks_needed(length) - len(hits))]
        seq.length = length
        seq.computed = length if computed else len(hits) * self.block_size
        if token_ids is not None and self.enable_prefix_caching:
            seq.tokens = list(token_ids)
            self._register_full_blocks(seq)
        self._seqs[seq_id] = seq
        self._take_state_slot(seq_id)
        return len(hits) * self.block_size

    def append(
        self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None, *, computed: bool = True
    ) -> list[BlockCopy]:
        """Grow a sequence by ``num_tokens`` slots; returns the block copies to perform first (copy-on-write).

        ``computed=False``: the new tokens' K/V are written later (``mark_computed``). Raises
        ``CacheFullError`` with nothing changed if the pool cannot hold them.
        """
        seq = self._get(seq_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"got {len(token_ids)} token ids for {num_tokens} tokens")
        needed = self.blocks_to_append(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise CacheFullError(
                f"appending {num_tokens} tokens to a sequence of {seq.length} needs {needed} "
                f"free blocks; the pool has {self.num_free_blocks} (of {self.num_blocks})"
            )
        copies = []
        if num_tokens and seq.length % self.block_size:  # the new tokens start inside the last block
            if self.ref_counts[seq.blocks[-1]] > 1:
                copies.append(self._copy_on_write(seq))
            else:
                self.prefix_cache.unregister(seq.blocks[-1])  # a registered block never changes under its key
        new_length = seq.length + num_tokens
        seq.blocks += [self._allocate() for _ in range(self.blocks_needed(new_length) - len(seq.blocks))]
        seq.length = new_length
        if computed:
            seq.computed = new_length
        if seq.tokens is not None:
            if token_ids is None:
                seq.tokens = None  # tokens unknown from here: no further prefix registration
            else:
                seq.tokens += list(token_ids)
                self._register_full_blocks(seq)
        return copies

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks (no data is copied)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        parent = self._get(parent_id)
        self._check_state_slot()
        for block in parent.blocks:
            self._ref(block)
        self._seqs[child_id] = _Sequence(
            list(parent.blocks),
            parent.length,
            None if parent.tokens is None else list(parent.tokens),
            list(parent.hashes),
            parent.computed,
            next(self._epochs),
            parent.salt,
            parent.salts_from,
        )
        if self._take_state_slot(child_id) is not None:
            self._state_copies.append(BlockCopy(self._state_of[parent_id], self._state_of[child_id]))

    def crop(self, seq_id: Hashable, length: int) -> None:
        """Shorten a sequence to its first ``length`` tokens, releasing blocks no longer needed."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot crop a sequence of {seq.length} tokens to {length}")
        if self.state_slots and length != seq.length:
            raise ValueError(
                f"sequence {seq_id!r} keeps recurrent state, which cannot be rolled back: it cannot be "
                f"cropped from {seq.length} to {length} tokens"
            )
        keep = self.blocks_needed(length)
        if keep < len(seq.blocks):
            seq.epoch = next(self._epochs)
        for block in seq.blocks[keep:]:
            self._unref(block)
        del seq.blocks[keep:]
        seq.length = length
        seq.computed = min(seq.computed, length)
        del seq.hashes[length // self.block_size :]
        if seq.tokens is not None:
            del seq.tokens[length:]

    def set_token(self, seq_id: Hashable, position: int, token: int) -> None:
        """Fill in a token that was appended before it was known (the engine schedules a sampled token's slot
        while the token is still on the device). Its K/V must not be computed yet: no block holds it."""
        seq = self._get(seq_id)
        if seq.tokens is None:
            return
        if not seq.computed <= position < len(seq.tokens):
            raise ValueError(
                f"token {position} of a sequence of {len(seq.tokens)} tokens, {seq.computed} of them "
                f"computed, cannot be set (only tokens not yet computed can)"
            )
        seq.tokens[position] = token

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """The K/V of the sequence's first ``num_tokens`` tokens are now in the pool (registers full blocks)."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.length:
            raise ValueError(f"a sequence of {seq.length} tokens cannot have {num_tokens} computed")
        seq.computed = max(seq.computed, num_tokens)
        if seq.tokens is not None:
            self._register_full_blocks(seq)

    def free(self, seq_id: Hashable) -> None:
        """End a sequence; blocks no other sequence holds return to the pool."""
        for block in self._seqs.pop(seq_id).blocks:
            self._unref(block)
        slot = self._state_of.pop(seq_id, None)
        if slot is not None:
            self._free_states.append(slot)
            self._state_copies = [copy for copy in self._state_copies if copy.dst != slot]

    def reset(self) -> None:
        for seq_id in list(self._seqs):
            self.free(seq_id)

    # --------------------------------------------------------------------------------------- internals
    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in the block manager") from None

    def _check_state_slot(self) -> None:
        if self.state_slots and not self._free_states:
            raise CacheFullError(f"every one of the {self.state_slots} state slots is held by a live sequence")

    def _take_state_slot(self, seq_id: Hashable) -> int | None:
        if not self.state_slots:
            return None
        self._state_of[seq_id] = slot = self._free_states.pop()
        return slot

    def blocks_to_append(self, seq: _Sequence | Hashable, num_tokens: int) -> int:
        """Free blocks that appending ``num_tokens`` to the sequence takes (new blocks + copy-on-write)."""
        if not isinstance(seq, _Sequence):
            seq = self._get(seq)
        grow = self.blocks_needed(seq.length + num_tokens) - len(seq.blocks)
        cow = num_tokens > 0 and seq.length % self.block_size != 0 and self.ref_counts[seq.blocks[-1]] > 1
        return grow + int(cow)

    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)
        self.prefix_cache.unregister(block)  # its old content is about to be overwritten
        self.ref_counts[block] = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
            self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise AssertionError(f"block {block} freed twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def _copy_on_write(self, seq: _Sequence) -> BlockCopy:
        shared = seq.blocks[-1]
        fresh = self._allocate()
        self._unref(shared)
        seq.blocks[-1] = fresh
        seq.epoch = next(self._epochs)
        return BlockCopy(shared, fresh)

    def _lookup(
        self,
        token_ids: Sequence[int] | None,
        num_tokens: int | None,
        salt: Hashable,
        salts_from: Salts,
        unsplit: Spans,
        found: PrefixHit | None = None,
    ) -> tuple[list[int], list[int], PrefixHit]:
        """A prompt's prefix-cache hits (``add_sequence``'s arguments; ``found``: what a probe with them found, kept
        while still registered), their hashes, and what adding it takes."""
        new_blocks = self.blocks_needed(_length(token_ids, num_tokens))
        caching = token_ids is not None and self.enable_prefix_caching
        if not caching:
            hits, hashes = [], []
        elif found is not None and self.prefix_cache.registered(found.blocks, found.hashes):
            hits, hashes = list(found.blocks), list(found.hashes)
        else:
            hits, hashes = self.prefix_cache.hits(token_ids, salt, salts_from, unsplit)
        cached_free = sum(1 for block in hits if self.ref_counts[block] == 0)
        taken = new_blocks - len(hits) + cached_free
        return hits, hashes, PrefixHit(len(hits) * self.block_size, taken, tuple(hits), tuple(hashes))

    def _register_full_blocks(self, seq: _Sequence) -> None:
        size = self.block_size
        while len(seq.hashes) < min(len(seq.tokens), seq.length, seq.computed) // size:
            index = len(seq.hashes)
            before = seq.hashes[-1] if seq.hashes else seq.salt
            tokens = seq.tokens[index * size : (index + 1) * size]
            digest = self.prefix_cache.register(seq.blocks[index], before, index * size, seq.salts_from, tokens)
            seq.hashes.append(digest)

    def check_invariants(self) -> None:
        """Raise AssertionError if the ref-counts, free pool or registrations are inconsistent."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.blocks) == self.blocks_needed(seq.length), "table length does not match length"
            assert len(set(seq.blocks)) == len(seq.blocks), "a block appears twice in one table"
            for block in seq.blocks:
                counts[block] += 1
        assert counts == self.ref_counts, "ref-counts differ from the tables"
        assert set(self._free) == {b for b, c in enumerate(counts) if c == 0}, "free pool differs from ref-counts"
        assert set(self._state_of) == (set(self._seqs) if self.state_slots else set()), "a sequence lacks a state slot"
        held = list(self._state_of.values())
        assert sorted(held + self._free_states) == list(range(self.state_slots)), "state slots lost or held twice"
        self.prefix_cache.check_invariants()


def _length(token_ids: Sequence[int] | None, num_tokens: int | None) -> int:
    """A prompt's length from ``add_sequence``'s ``token_ids`` or ``num_tokens``."""
    length = len(token_ids) if token_ids is not None else num_tokens
    if length is None or length < 0:
        raise ValueError(f"add_sequence needs token_ids or a num_tokens >= 0; got num_tokens={num_tokens}")
    return length
