"""``DeviceBlockTables``: the decode steps' block tables, kept on the device and updated incrementally."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from hfaccel.device import to_device
from hfaccel.kv.block_manager import BlockManager


class DeviceBlockTables:
    """The block tables of a pool's sequences, kept on the device and updated incrementally, for the decode steps
    (``hfaccel.runner.graphs``): each sequence has a row of ``table [rows, width]`` for as long as the block manager
    holds it, and a step sends up only what changed since the last — the blocks a sequence appended, or its whole
    table after a copy-on-write or a crop (:meth:`BlockManager.table_epoch`) — together with the step's rows and
    positions in one non-blocking copy, instead of every sequence's table rebuilt from Python lists each step.

    Rows of sequences the manager no longer holds are reused once the table runs out of rows; it grows (doubling)
    only when every row is held.
    """

    def __init__(self, manager: BlockManager, width: int, device: torch.device, rows: int = 64):
        self.manager, self.width, self.device = manager, width, device
        self.table = torch.zeros(max(rows, 1), width, dtype=torch.int32, device=device)  # [rows, W]
        self._row: dict[Hashable, int] = {}  # sequence -> its row
        self._synced: dict[Hashable, tuple[int, int]] = {}  # sequence -> (table epoch, blocks on the device)
        self._free_rows = list(range(len(self.table) - 1, -1, -1))

    def upload(
        self, seq_ids: Sequence[Hashable], ends: Sequence[int], columns: Sequence[Sequence[int]], size: int
    ) -> torch.Tensor:
        """The sequences' tables brought up to date on the device, and ``columns`` (host values, one per sequence:
        e.g. each sequence's start and token count) put there with them, in one non-blocking copy, for a step of
        ``size >= len(seq_ids)`` rows.
        ``ends[i]``: the length the step needs sequence ``i`` to hold (a ``ValueError`` if it holds fewer slots).
        Returns ``[1 + len(columns), size]`` int64 on the device: the sequences' rows of :attr:`table`, then the
        columns; the padding rows past ``len(seq_ids)`` hold 0 (row 0 of the table, whatever it holds)."""
        changed: list[tuple[int, int, list[int]]] = []  # (row, first column, blocks) the device lacks
        rows = [self._sync(seq_id, end, changed) for seq_id, end in zip(seq_ids, ends)]
        flat = rows + [0] * (size - len(rows))
        for column in columns:
            flat += list(column) + [0] * (size - len(column))
        update_rows, update_columns, update_blocks = [], [], []
        for row, first, blocks in changed:
            update_rows += [row] * len(blocks)
            update_columns += range(first, first + len(blocks))
            update_blocks += blocks
        flat += update_rows + update_columns + update_blocks
        moved = to_device(flat, torch.int64, self.device)
        head = size * (1 + len(columns))
        if len(flat) > head:
            where = moved[head:].view(3, -1)  # [3, U]: rows, columns, blocks
            self.table.index_put_((where[0], where[1]), where[2].to(torch.int32))
        return moved[:head].view(1 + len(columns), size)

    def _sync(self, seq_id: Hashable, end: int, changed: list[tuple[int, int, list[int]]]) -> int:
        """The sequence's row; the blocks of its table the device lacks appended to ``changed``."""
        manager = self.manager
        if end > manager.seq_len(seq_id):
            raise ValueError(f"sequence {seq_id!r} holds {manager.seq_len(seq_id)} slots; a step needs {end}")
        blocks, epoch = manager.block_table(seq_id), manager.table_epoch(seq_id)
        if len(blocks) > self.width:
            raise ValueError(
                f"a sequence of {len(blocks)} blocks exceeds the decode steps' tables of {self.width} "
                f"blocks (max_model_len)"
            )
        row = self._row.get(seq_id)
        if row is None:
            row = self._row[seq_id] = self._take_row()
        synced_epoch, done = self._synced.get(seq_id, (0, 0))
        if synced_epoch != epoch:
            done = 0
        if len(blocks) > done:
            changed.append((row, done, blocks[done:]))
        self._synced[seq_id] = (epoch, len(blocks))
        return row

    def _take_row(self) -> int:
        """A free row: one no sequence holds, else one of a sequence the manager has let go, else a new one."""
        if not self._free_rows:
            gone = [seq_id for seq_id in self._row if seq_id not in self.manager]
            for seq_id in gone:
                self._free_rows.append(self._row.pop(seq_id))
                del self._synced[seq_id]
        if not self._free_rows:
            old = self.table
            self.table = torch.zeros(2 * len(old), self.width, dtype=old.dtype, device=self.device)
            self.table[: len(old)] = old
            self._free_rows = list(range(len(self.table) - 1, len(old) - 1, -1))
        return self._free_rows.pop()
