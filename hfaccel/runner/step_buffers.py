"""The static buffers a :class:`~hfaccel.runner.graphs.DecodeGraphs` step reads — one set for every step, since a
compiled and captured step reads the same tensors each replay — and how a step's sequences fill them.

A step's rows are its sequences, then padding rows that read and write nothing (slot ``-1``, length 0, the scratch
state slot). Where one sequence runs padded to two on a mixture of experts, row 1 instead mirrors row 0: its block
table, positions, length, tokens, LoRA slot and state slot, with slot ``-1`` so that it writes no K/V and its state
goes to the scratch slot (:func:`~hfaccel.runner.step_function.static_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hfaccel.device import to_device
from hfaccel.kv import DeviceBlockTables, token_metadata
from hfaccel.sampling.sampler import DRAW_COLUMNS

if TYPE_CHECKING:
    from hfaccel.runner.runner import ModelRunner


class StepBuffers:
    """Static inputs of steps of up to ``max_batch`` sequences of up to ``max_model_len`` tokens, ``tokens_per_seq``
    tokens each; ``last_only``: a step keeps the logits of each sequence's last real token (else of every token)."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, tokens_per_seq: int, last_only: bool):
        self.runner, self.device = runner, runner.device
        self.tokens_per_seq, self.last_only = tokens_per_seq, last_only
        width, tokens = -(-max_model_len // runner.pool.block_size), max_batch * tokens_per_seq
        on = {"device": self.device}
        self.input_ids = torch.zeros(tokens, dtype=torch.long, **on)
        self.positions = torch.zeros(tokens, dtype=torch.long, **on)
        self.slot_mapping = torch.full((1, tokens), -1, dtype=torch.long, **on)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, **on)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, **on)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, **on) * tokens_per_seq
        self.lora_index = torch.full((tokens,), -1, dtype=torch.long, **on)  # each token's LoRA slot (-1: none)
        self.state_slots = torch.zeros(max_batch, dtype=torch.long, **on)  # each row's state slot (recurrent layers)
        self.position_offsets = torch.zeros(tokens, dtype=torch.long, **on)  # each token's (runner.position_offsets)
        self.draw_columns = torch.zeros(len(DRAW_COLUMNS), max_batch, dtype=torch.long, **on)  # [8, B]: draw_step's
        # the tokens whose logits a step returns: every token, or (last_only) each sequence's last real one
        self.keep = (
            torch.arange(max_batch, dtype=torch.long, **on) * tokens_per_seq
            if self.last_only
            else torch.arange(tokens, dtype=torch.long, **on)
        )
        self._tables = DeviceBlockTables(runner.pool.manager, width, self.device, rows=max_batch)
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # per size: the buffers' leading rows (made once)

    def pad(self) -> None:
        """Make every row a padding row: it reads and writes nothing."""
        positions, seq_lens, slot_mapping, lora_index, draw_columns, state_slots, offsets = self._padded()
        positions.zero_()
        seq_lens.zero_()
        slot_mapping.fill_(-1)
        lora_index.fill_(-1)
        draw_columns.zero_()
        state_slots.fill_(self.scratch_slot())
        offsets.zero_()

    def pool_changed(self) -> None:
        """The runner's pool was replaced: block tables of its blocks from now on."""
        self._tables = DeviceBlockTables(
            self.runner.pool.manager, self._tables.width, self.device, rows=len(self._tables.table)
        )

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of what :meth:`pad` overwrites, for :meth:`restore`."""
        return [buffer.clone() for buffer in self._padded()]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        """Put back what :meth:`snapshot` copied."""
        for buffer, saved in zip(self._padded(), snapshot):
            buffer.copy_(saved)

    def _padded(self) -> tuple[torch.Tensor, ...]:
        return (
            self.positions,
            self.seq_lens,
            self.slot_mapping,
            self.lora_index,
            self.draw_columns,
            self.state_slots,
            self.position_offsets,
        )

    def set_tokens(
        self, input_ids: torch.Tensor, mirror: bool, where: torch.Tensor | None = None, size: int = 0
    ) -> None:
        """A step's tokens into the leading rows: one per sequence (``input_ids [B]``), or for steps of several per
        sequence the packed ``input_ids [T]`` at the token indices ``where [T]`` of ``size`` rows (the rest 0). With
        ``mirror``, row 1 then takes row 0's tokens."""
        if where is None:
            self.input_ids[: input_ids.shape[0]].copy_(input_ids)
        else:
            self.input_ids[: size * self.tokens_per_seq].zero_().index_copy_(0, where, input_ids)
        if mirror:
            q = self.tokens_per_seq
            self.input_ids[q : 2 * q].copy_(self.input_ids[:q])

    def fill(
        self, seq_ids, starts, size: int, num_new: list[int], draw: list[list[int]] = (), mirror: bool = False
    ) -> None:
        """Bring a step's metadata into the static buffers: the rows' block tables from the pool's device tables
        (only what changed goes up, with the starts, token counts and ``draw`` columns, in one non-blocking copy),
        then positions, slots and lengths computed on the device (:func:`hfaccel.kv.pool.token_metadata`, the rule
        the eager forwards follow). The tables hold every block of each sequence, so device-fed steps can read
        ahead. With ``mirror``, row 1 mirrors row 0 (module docstring)."""
        if mirror:
            seq_ids, starts, num_new = [*seq_ids, seq_ids[0]], [*starts, starts[0]], [*num_new, num_new[0]]
        ends = [start + n for start, n in zip(starts, num_new)]
        states = [self._state_slots(seq_ids, size)] if self.runner.pool.states is not None else []
        offsets = [[self.runner.position_offsets.get(s, 0) for s in seq_ids]] if self.runner.offsets_positions else []
        moved = self._tables.upload(seq_ids, ends, [starts, num_new, *draw, *states, *offsets], size)  # [3 + ..., size]
        rows, start, real = moved[:3]
        if draw:
            self.draw_columns[:, :size].copy_(moved[3 : 3 + len(draw)])
        if states:
            self.state_slots[:size].copy_(moved[3 + len(draw)])
        if offsets:
            self.position_offsets[: size * self.tokens_per_seq].copy_(moved[-1].repeat_interleave(self.tokens_per_seq))
        torch.index_select(self._tables.table, 0, rows, out=self.block_tables[:size])  # [size, W]
        tokens = size * self.tokens_per_seq
        positions, slots, lens, cu = token_metadata(
            self._tables.table,
            rows,
            start,
            real,
            torch.full_like(real, self.tokens_per_seq),
            tokens,
            self.runner.pool.block_size,
        )
        self.positions[:tokens].copy_(positions)
        self.seq_lens[:size].copy_(lens)
        self.slot_mapping[0, :tokens].copy_(slots)
        if self.last_only:  # each sequence's last real token (a padding row: its first, whose logits are dropped)
            self.keep[:size].copy_(cu[:-1] + (real - 1).clamp_min(0))
        if mirror:
            self.slot_mapping[0, self.tokens_per_seq : 2 * self.tokens_per_seq].fill_(-1)

    def _state_slots(self, seq_ids, size: int) -> list[int]:
        """Each row's state slot (the padding rows the scratch slot)."""
        manager = self.runner.pool.manager
        return [manager.state_slot(s) for s in seq_ids] + [self.scratch_slot()] * (size - len(seq_ids))

    def scratch_slot(self) -> int:
        """The state slot padding rows read and write (0 where no layer keeps state)."""
        states = self.runner.pool.states
        return 0 if states is None else states.scratch

    def fill_lora(self, lora_slots: Sequence[int] | None, size: int, mirror: bool = False) -> bool:
        """Bring each token's LoRA slot into its static buffer (padding rows -1, a mirror row its sequence's; one
        non-blocking copy); False (the variant without LoRA ops) when no row takes an adapter."""
        present = sorted({slot for slot in lora_slots if slot >= 0}) if lora_slots is not None else []
        if not present:
            return False
        if mirror:
            lora_slots = [*lora_slots, lora_slots[0]]
        q = self.tokens_per_seq
        per_token = [slot for slot in lora_slots for _ in range(q)] + [-1] * ((size - len(lora_slots)) * q)
        self.lora_index[: size * q].copy_(to_device(per_token, torch.long, self.device))
        self.runner.lora.slots = present
        return True

    def rows(self, size: int) -> tuple[torch.Tensor, ...]:
        """The static buffers' views for a step of ``size`` sequences (``size * tokens_per_seq`` tokens)."""
        if size not in self._views:
            tokens = size * self.tokens_per_seq
            self._views[size] = (
                self.input_ids[:tokens],
                self.positions[:tokens],
                self.seq_lens[:size],
                self.slot_mapping[:, :tokens],
                self.block_tables[:size],
                self.cu_seqlens_q[: size + 1],
                self.keep[: size if self.last_only else tokens],
                torch.arange(size, device=self.device),
                self.lora_index[:tokens],
                self.state_slots[:size],
                self.position_offsets[:tokens],
            )
        return self._views[size]
