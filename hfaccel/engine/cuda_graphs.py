"""Decode-only steps replayed from CUDA graphs, one per padded batch size of a ladder.

A decode step feeds one token per sequence. Its inputs live in static buffers sized for the largest batch:
token ids, positions, slot mapping, block tables (one row per sequence, ``max_model_len / block_size`` wide),
sequence lengths and ``cu_seqlens_q``. A step of ``B`` sequences runs the graph of the smallest ladder size
``>= B``; the padding rows write nowhere (slot ``-1``, which ``write_kv`` skips) and see no keys (length 0, so
the paged kernel returns zeros for them), and their logits are dropped. The model's forward runs once per size
to warm up (Triton compiles), then is captured; later steps only copy their inputs into the buffers and replay.

The paged kernel's launch (grid, split-K factor) is fixed at capture from ``max_model_len``; per-sequence
work still follows the device-side lengths. Without CUDA (or when capture fails) the same static-buffer step
runs eagerly, which is what the CPU tests check.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from hfaccel.engine.runner import ModelRunner, PackedStep

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Static-shape decode steps for up to ``max_batch`` sequences of up to ``max_model_len`` tokens."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, *, capture: bool | None = None,
                 ladder: Sequence[int] = DEFAULT_LADDER):
        self.runner = runner
        self.device = runner.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sizes = sorted({size for size in ladder if size < max_batch} | {max_batch})
        self.max_batch, self.max_model_len = max_batch, max_model_len
        width = -(-max_model_len // runner.cache.block_size)
        on = {"device": self.device}
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, **on)
        self.positions = torch.zeros(max_batch, dtype=torch.long, **on)
        self.slot_mapping = torch.full((1, max_batch), -1, dtype=torch.long, **on)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, **on)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, **on)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, **on)
        self.keep = torch.arange(max_batch, dtype=torch.long, **on)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def serves(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch

    @torch.inference_mode()
    def run(self, seq_ids: Sequence, tokens: Sequence[int], starts: Sequence[int],
            device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode token per sequence (token ``tokens[i]`` at position ``starts[i]``).

        ``device_tokens = (rows [F], ids [F])``, on the device: tokens the host does not know yet (sampled by
        the step still running), copied device-to-device over ``tokens[rows]``.
        """
        batch = len(seq_ids)
        size = next(s for s in self.sizes if s >= batch)
        self._fill(seq_ids, tokens, starts, size)
        if device_tokens is not None:
            self.input_ids.index_copy_(0, *device_tokens)
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
    def _fill(self, seq_ids, tokens, starts, size: int) -> None:
        """Copy a step's inputs into the static buffers (one non-blocking host-to-device copy per buffer)."""
        manager, block = self.runner.cache.manager, self.runner.cache.block_size
        batch = len(seq_ids)
        rows = [manager.block_table(seq_id) for seq_id in seq_ids]
        pinned = {"pin_memory": self.device.type == "cuda"}
        # only the columns these sequences use: the kernel never reads a table past a sequence's length
        width = max(len(row) for row in rows)
        tables = torch.tensor([row + [0] * (width - len(row)) for row in rows] + [[0] * width] * (size - batch),
                              dtype=torch.int32, **pinned)
        pad = [0] * (size - batch)
        slots = torch.tensor([[row[pos // block] * block + pos % block for row, pos in zip(rows, starts)]
                              + [-1] * (size - batch)], dtype=torch.long, **pinned)
        lens = torch.tensor([pos + 1 for pos in starts] + pad, dtype=torch.int32, **pinned)
        ids = torch.tensor([max(t, 0) for t in tokens] + pad, dtype=torch.long, **pinned)
        positions = torch.tensor(list(starts) + pad, dtype=torch.long, **pinned)
        for static, host in ((self.input_ids, ids), (self.positions, positions), (self.seq_lens, lens)):
            static[:size].copy_(host, non_blocking=True)
        self.slot_mapping[:, :size].copy_(slots, non_blocking=True)
        self.block_tables[:size, :width].copy_(tables, non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:
        cache = self.runner.cache
        cache.step = PackedStep(slot_mapping=self.slot_mapping[:, :size], block_tables=self.block_tables[:size],
                                seq_lens=self.seq_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                                positions=self.positions[:size], max_seq_len=self.max_model_len, max_q_len=1)
        try:
            out = self.runner.model(input_ids=self.input_ids[:size][None], position_ids=self.positions[:size][None],
                                    past_key_values=cache, use_cache=True, logits_to_keep=self.keep[:size])
        finally:
            cache.step = None
        return out.logits[0]

    def _capture(self, size: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(size)
        except Exception as error:  # a model whose forward cannot be captured: stay eager, say why
            warnings.warn(f"hfaccel: CUDA graph capture failed ({error!r}); decode steps run eagerly",
                          stacklevel=3)
            self.capture = False
            torch.cuda.synchronize(self.device)
            return
        self._pool = graph.pool()
        self._graphs[size] = (graph, logits)
