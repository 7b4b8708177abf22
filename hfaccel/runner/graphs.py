"""The runner's decode mode: steps of one token per sequence, replayed from CUDA graphs per padded batch size.

A decode step's inputs live in static buffers sized for the largest batch: token ids, positions, slot mapping,
block tables (one row per sequence, ``max_model_len / block_size`` wide), sequence lengths and
``cu_seqlens_q``. A step of ``B`` sequences runs the graph of the smallest ladder size ``>= B``; the padding rows
write nowhere (slot ``-1``, which ``write_kv`` skips) and see no keys (length 0, so the paged kernel returns
zeros for them), and their logits are dropped. The model's forward runs once per size to warm up (Triton
compiles), then is captured; later steps only copy their inputs into the buffers and replay.

The paged kernel's launch (grid, split-K factor) is fixed at capture from ``max_model_len``; per-sequence
work still follows the device-side lengths. Without CUDA (or when capture fails) the same static-buffer step
runs eagerly, which is what the CPU tests check.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from hfaccel.kv import PackedStep

if TYPE_CHECKING:
    from hfaccel.runner.runner import ModelRunner

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Static-shape decode steps of a :class:`ModelRunner` for up to ``max_batch`` sequences of up to
    ``max_model_len`` tokens (made by ``runner.enable_decode_graphs``)."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, *, capture: bool | None = None,
                 ladder: Sequence[int] = DEFAULT_LADDER):
        self.runner = runner
        self.device = runner.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sizes = sorted({size for size in ladder if size < max_batch} | {max_batch})
        self.max_batch, self.max_model_len = max_batch, max_model_len
        width = -(-max_model_len // runner.pool.block_size)
        on = {"device": self.device}
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, **on)
        self.positions = torch.zeros(max_batch, dtype=torch.long, **on)
        self.slot_mapping = torch.full((1, max_batch), -1, dtype=torch.long, **on)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, **on)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, **on)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, **on)
        self.keep = torch.arange(max_batch, dtype=torch.long, **on)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memory_pool = None

    def serves(self, num_new: Sequence[int], logits_for: str | Sequence[int]) -> bool:
        """Whether a forward is a decode step this mode runs: one token per sequence, logits for each of them."""
        if not 0 < len(num_new) <= self.max_batch or any(n != 1 for n in num_new):
            return False
        return isinstance(logits_for, str) or list(logits_for) == list(range(len(num_new)))

    def run(self, seq_ids: Sequence[Hashable], input_ids: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode token per sequence (``input_ids[i]`` at position ``starts[i]``)."""
        batch = len(seq_ids)
        size = next(s for s in self.sizes if s >= batch)
        self._fill(seq_ids, input_ids, starts, size)
        if not self.capture:
            return self._forward(size)[:batch]
        if size not in self._graphs:
            self._capture(size)
            if not self.capture:  # capture failed: eager from now on
                return self._forward(size)[:batch]
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:batch]

    # --------------------------------------------------------------------------------------- internals
    def _fill(self, seq_ids, input_ids: torch.Tensor, starts, size: int) -> None:
        """Copy a step's inputs into the static buffers (one non-blocking copy per buffer; of the block tables,
        only the columns these sequences use: the kernel never reads a table past a sequence's length)."""
        batch = len(seq_ids)
        host = self.runner.pool.packed_step(seq_ids, starts, [1] * batch, num_rows=size)
        pinned = self.device.type == "cuda"
        for static, values in ((self.positions, host.positions), (self.seq_lens, host.seq_lens),
                               (self.slot_mapping[0], host.slot_mapping[0])):
            static[:size].copy_(values.pin_memory() if pinned else values, non_blocking=True)
        tables = host.block_tables
        self.block_tables[:size, :tables.shape[1]].copy_(tables.pin_memory() if pinned else tables,
                                                         non_blocking=True)
        self.input_ids[:batch].copy_(input_ids)

    def _forward(self, size: int) -> torch.Tensor:
        step = PackedStep(slot_mapping=self.slot_mapping[:, :size], block_tables=self.block_tables[:size],
                          seq_lens=self.seq_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                          positions=self.positions[:size], max_seq_len=self.max_model_len, max_q_len=1)
        return self.runner.run_model(self.input_ids[:size], step, self.keep[:size])

    def _capture(self, size: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._memory_pool):
                logits = self._forward(size)
        except Exception as error:  # a model whose forward cannot be captured: stay eager, say why
            warnings.warn(f"hfaccel: CUDA graph capture failed ({error!r}); decode steps run eagerly",
                          stacklevel=3)
            self.capture = False
            torch.cuda.synchronize(self.device)
            return
        self._memory_pool = graph.pool()
        self._graphs[size] = (graph, logits)
