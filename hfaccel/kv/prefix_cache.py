"""The block manager's prefix cache: which pool block holds a full block of given tokens after a given prefix.

Each full block whose tokens are known and whose K/V have been computed is registered under the hash of its key:
(what it chains to, its own tokens). What a block chains to is the hash of the block before it — for a sequence's
first block, its ``salt`` (None, or e.g. the LoRA adapter that computes it: the same tokens under another adapter
have other K/V) — with each of its ``salts_from`` mixed in at the block holding a given token (a prompt's images, each
at its first token: the blocks before an image are keyed without it, so the text and images before it are shared
with any prompt that has them, and every block from it on depends on it through the chain). A prompt whose leading
full blocks have registered keys under the same salts reuses those blocks. A key names one block and a block has one
key at most; registrations live until the block is reused or written (:meth:`PrefixCache.unregister`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

Salts = tuple[tuple[int, Hashable], ...]  # (token, salt): mixed into the key of the block holding the token
Spans = tuple[tuple[int, int], ...]  # token spans (start, end)


class PrefixCache:
    """Registered full blocks by the hash of their key, over blocks of ``block_size`` tokens."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[int, int] = {}  # key hash -> block
        self._keys: dict[int, tuple[Hashable, tuple[int, ...]]] = {}  # block -> (what it chains to, its tokens)

    def hits(
        self,
        tokens: Sequence[int],
        salt: Hashable,
        salts_from: Salts,
        unsplit: Spans,
    ) -> tuple[list[int], list[int]]:
        """The registered blocks holding the leading full blocks of ``tokens`` under ``salt`` and ``salts_from``, and
        their key hashes; a hit that would end inside one of the token spans ``unsplit`` (``(start, end)``) is cut
        back to the block boundary at or before its start. A hit never covers the last token: the caller must run at
        least one token for its logits."""
        hits, hashes, before = [], [], salt
        for start in range(0, len(tokens) - self.block_size, self.block_size):
            key = (self._salted(before, start, salts_from), tuple(tokens[start : start + self.block_size]))
            block = self._blocks.get(hash(key))
            if block is None or self._keys.get(block) != key:
                break
            hits.append(block)
            before = hash(key)
            hashes.append(before)
        kept = self._unsplit_end(len(hits) * self.block_size, unsplit) // self.block_size
        return hits[:kept], hashes[:kept]

    def register(self, block: int, before: Hashable, start: int, salts_from: Salts, tokens: Sequence[int]) -> int:
        """Register ``block``, holding ``tokens`` (the full block starting at token ``start`` of its sequence) after
        ``before`` (the hash of the block before it, or the sequence's salt), unless its key or the block is
        registered already; returns the key's hash, which the next block chains to."""
        key = (self._salted(before, start, salts_from), tuple(tokens))
        digest = hash(key)
        if digest not in self._blocks and block not in self._keys:
            self._blocks[digest] = block
            self._keys[block] = key
        return digest

    def registered(self, blocks: Sequence[int], hashes: Sequence[int]) -> bool:
        """Whether each of ``blocks`` is still registered under the key hash beside it in ``hashes``."""
        return all(self._blocks.get(digest) == block for block, digest in zip(blocks, hashes, strict=True))

    def unregister(self, block: int) -> None:
        """Forget what ``block`` holds (it is about to be written, or reused for other tokens)."""
        key = self._keys.pop(block, None)
        if key is not None and self._blocks.get(hash(key)) == block:
            del self._blocks[hash(key)]

    def check_invariants(self) -> None:
        """Raise AssertionError if a key hash names a block registered under another key."""
        for digest, block in self._blocks.items():
            assert hash(self._keys[block]) == digest, "registration points at a block with other content"

    def _salted(self, before: Hashable, start: int, salts_from: Salts) -> Hashable:
        """What the key of the block starting at token ``start`` chains to: ``before``, with the salts of
        ``salts_from`` whose token the block holds mixed in."""
        salts = tuple(salt for token, salt in salts_from if start <= token < start + self.block_size)
        return (before, *salts) if salts else before

    def _unsplit_end(self, end: int, unsplit: Spans) -> int:
        """``end`` (a block boundary), cut back to the block boundary at or before the start of any span of
        ``unsplit`` it falls inside, until it falls inside none."""
        while inside := [start for start, stop in unsplit if start < end < stop]:
            end = min(inside) // self.block_size * self.block_size
        return end
