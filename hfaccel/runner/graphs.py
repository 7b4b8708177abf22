"""The runner's decode mode: steps of one token per sequence (or a few: speculative verification) with static
shapes, compiled, and replayed from CUDA graphs per padded batch size, so that a decode step costs one launch.

A step of ``B`` sequences runs at the smallest ladder size ``>= B`` on static buffers sized for the largest; its
padding rows write nowhere (slot ``-1``) and see no keys (length 0), their logits dropped — except the one row that
pads a step of one sequence on a model that routes tokens to experts: it repeats that sequence, reading its keys
and state and writing nowhere, so that it activates no other expert (:func:`routed_expert_banks`). The host feeds a step
(:meth:`DecodeGraphs.run`, one non-blocking copy), or the device does (:meth:`DecodeGraphs.begin` then
:meth:`DecodeGraphs.advance`: ``generate``'s rows move on one token a step). Only the batch and the pool's block
count are dynamic (:func:`mark_step_dynamic`), so one compiled graph serves every size; a size that cannot be
compiled or captured runs eagerly with its reason (:meth:`DecodeGraphs.status`). docs/architecture.md: the details.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from hfaccel import compat
from hfaccel.device import to_device
from hfaccel.kernels.attention_tiles import BATCH_LADDER
from hfaccel.kv import PackedStep
from hfaccel.runner.step_buffers import StepBuffers
from hfaccel.runner.step_function import (
    compiled_call,
    compiled_function,
    failure_reason,
    mark_draw_dynamic,
    mark_step_dynamic,
    recompile_reason,
    release_generator_from_capture,
    static_step,
)
from hfaccel.sampling.sampler import SampleRow, draw_columns, draw_step

if TYPE_CHECKING:
    from hfaccel.runner.runner import ModelRunner

_log = logging.getLogger("hfaccel")
DEFAULT_LADDER = BATCH_LADDER  # the padded batch sizes of decode steps (hfaccel.kernels.attention_tiles)
MIN_CONTEXT_BUCKET = 64  # uncompiled, uncaptured steps are built for contexts of powers of two from here
# the context compiled or captured steps are built for when the model states no max_position_embeddings (Mamba):
# this, then each power of two above it
OPEN_CONTEXT_BUCKET = 1 << 16


# the attributes transformers' ``use_experts_implementation`` gives the expert banks it dispatches
_EXPERTS_INTERFACE = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def routed_expert_banks(model) -> list[torch.nn.Module]:
    """The model's expert banks (``num_experts`` and ``[num_experts, ...]`` weights) that read only the experts their
    tokens are routed to: those transformers runs through its experts interface (grouped_mm, batched_mm and eager
    all index the routed experts). A bank of another kind — Llama 4's runs every expert on every token — reads all."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "num_experts", None), int)
        and all(hasattr(module, name) for name in _EXPERTS_INTERFACE)
    ]


def compiles(setting: bool | str, device: torch.device) -> bool:
    """Whether decode steps on ``device`` are compiled for a ``compile`` setting: True, False or ``"auto"`` (on
    CUDA, where the glue between kernels is worth fusing). Any other value is a ``ValueError``."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto'; got {setting!r}")
    return setting is True or (setting == "auto" and device.type == "cuda")


def context_bucket(context: int, *, whole: bool, model, floor: int = MIN_CONTEXT_BUCKET) -> int:
    """The context static steps are built for: compiled or captured steps (``whole``) for the model's whole context
    (``max_position_embeddings``) at once, so that nothing compiles again; plain eager steps, which rebuild for
    free, for the power of two that holds ``context`` (at least ``floor``) — the paged kernel's launch (its split
    count) is sized by it, so a short context runs no empty splits. A model stating no whole context gets compiled
    or captured steps for :data:`OPEN_CONTEXT_BUCKET` tokens, or the power of two above that holds ``context``."""
    if whole:
        config = model.config.get_text_config(decoder=True)
        limit = int(getattr(config, "max_position_embeddings", None) or 0)
        if limit:
            return max(context, limit)
        floor = OPEN_CONTEXT_BUCKET
    return max(floor, 1 << (context - 1).bit_length())


class DecodeGraphs:
    """Static-shape steps of a :class:`ModelRunner` for up to ``max_batch`` sequences of up to ``max_model_len``
    tokens (made by ``runner.enable_decode_graphs``): one token per sequence (decode), or up to
    ``tokens_per_seq``, padded to that many, with the logits of every token (``logits_for="all"``: speculative
    verification, the last token and the drafts) or of each sequence's last (``"last"``: a draft model catching up
    on the tokens the target accepted)."""

    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        max_model_len: int,
        *,
        tokens_per_seq: int = 1,
        logits_for: str = "all",
        capture: bool | None = None,
        compile: bool = False,
        ladder: Sequence[int] = DEFAULT_LADDER,
        draws: bool = False,
    ):
        if max_batch < 1 or max_model_len < 1 or tokens_per_seq < 1:
            raise ValueError(
                f"max_batch, max_model_len and tokens_per_seq must be >= 1; got {max_batch}, "
                f"{max_model_len}, {tokens_per_seq}"
            )
        if logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all' or 'last'; got {logits_for!r}")
        if draws and tokens_per_seq != 1:
            raise ValueError(f"steps that draw their tokens take one token per sequence; got {tokens_per_seq}")
        self.runner = runner
        self.device = runner.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.compiled = compile
        # a model whose layers read every token their sequences hold outside the paged kernel, each step (MLA layers
        # that expand their latents, sparse attention's indexers): its steps run at their batch's context (the power
        # of two holding its longest sequence), so uncompiled and uncaptured
        self.eager_reason = None
        if runner.context_reason is not None and (self.capture or self.compiled):
            self.eager_reason = runner.context_reason
            self.capture = self.compiled = False
        self._held = 0  # the longest sequence of the next step, which such steps run at
        self.sizes = sorted({size for size in ladder if size < max_batch} | {max_batch})
        self.max_batch, self.max_model_len, self.tokens_per_seq = max_batch, max_model_len, tokens_per_seq
        self.last_only = tokens_per_seq > 1 and logits_for == "last"  # logits of each sequence's last real token
        self.draws = draws  # whether run(draw=...) can draw the tokens inside the step
        self.buffers = StepBuffers(runner, max_batch, max_model_len, tokens_per_seq, self.last_only)
        # dynamic=None: static except the dimensions marked dynamic (mark_step_dynamic), so one graph per mode
        # serves every batch size and pool size; each size is then captured as its own CUDA graph
        self._step_fn = compiled_function(static_step) if self.compiled else static_step
        self._draw_fn = compiled_function(draw_step) if self.compiled and draws else draw_step
        self.compile_failure: str | None = None  # why the step runs uncompiled, when compiling failed
        # the (advance, lora) variants the compiled step was traced for, and for those settled, why steps of one
        # sequence run at the next size (None: at size 1)
        self._traced: set[tuple[bool, bool]] = set()
        self._size_one: dict[tuple[bool, bool], str | None] = {}
        # a step of one sequence padded to the next size (see _size_for) fills its padding row as a mirror of it
        self.mirror_padding = bool(routed_expert_banks(runner.model))
        self.draw_compile_failure: str | None = None  # why the draw runs uncompiled, when compiling it failed
        # (size, advance, lora, draw) -> why it runs uncaptured
        self.capture_failures: dict[tuple[int, bool, bool, bool], str] = {}
        self._graphs: dict[tuple[int, bool, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memory_pool = None
        self._size: int | None = None  # the size begun by ``begin`` (advance mode)
        self._mirror = False  # whether the steps begun by ``begin`` fill a mirror row
        # under tensor parallelism (set by the engine): every rank's verdict on a capture — True when all of them
        # captured — so that all ranks replay a size or none does (a replay on one rank alone would hang its peers)
        self.agree: Callable[[bool], bool] | None = None

    def status(self) -> str:
        """How the steps run, in one line: compiled or not, captured sizes, and the reasons of any fallback."""
        failure = self.compile_failure or self.eager_reason
        parts = ["compiled" if self.compiled else ("uncompiled" if failure is None else f"uncompiled ({failure})")]
        if self.draw_compile_failure is not None:
            parts.append(f"draw uncompiled ({self.draw_compile_failure})")
        reason = next((reason for reason in self._size_one.values() if reason is not None), None)
        if reason is not None:
            parts.append(f"batch 1 runs at {self.sizes[1]} ({reason})")
        if self.capture:
            parts.append(f"CUDA graphs for sizes {sorted({size for size, *_ in self._graphs})}")
        parts += [
            f"size {size}{' (LoRA)' if lora else ''}{' (drawing)' if draw else ''} uncaptured ({reason})"
            for (size, _, lora, draw), reason in sorted(self.capture_failures.items())
        ]
        return ", ".join(parts)

    def pool_changed(self) -> None:
        """The runner's pool was replaced (a larger one): the captured graphs read the old one's memory and are
        dropped; the compiled step serves the new pool as it is (its block count is symbolic)."""
        self._graphs.clear()
        self._memory_pool = None
        self.buffers.pool_changed()

    @torch.inference_mode()  # as the runner's forwards run
    def warm_up(self, sizes: Sequence[int] | None = None, progress=None) -> None:
        """Compile and capture the steps of ``sizes`` (default: every size; with LoRA layers and with ``draws``, each
        variant) now, on padding rows that read and write nothing, so that no request waits for them.
        ``progress(done, total)`` is called after each size."""
        sizes = list(self.sizes if sizes is None else sizes)
        for done, size in enumerate(sizes, 1):
            for lora in (False, True) if self.runner.lora is not None else (False,):
                for draw in (False, True) if self.draws else (False,):
                    padded = self._size_for(size, advance=False, lora=lora)
                    self._pad_rows()
                    self._replay(padded, advance=False, lora=lora, draw=draw)
            if progress is not None:
                progress(done, len(sizes))

    def _pad_rows(self) -> None:
        """Make every row of the buffers a padding row: it reads and writes nothing."""
        self.buffers.pad()
        self._size = None

    def serves(self, num_new: Sequence[int], logits_for: str | Sequence[int]) -> bool:
        """Whether a forward is a step this mode runs: one token per sequence with logits for each of them, or
        (``tokens_per_seq > 1``) up to ``tokens_per_seq`` per sequence with logits for every token."""
        if not 0 < len(num_new) <= self.max_batch:
            return False
        if self.tokens_per_seq > 1:
            return logits_for == ("last" if self.last_only else "all") and all(
                1 <= n <= self.tokens_per_seq for n in num_new
            )
        if any(n != 1 for n in num_new):
            return False
        return isinstance(logits_for, str) or list(logits_for) == list(range(len(num_new)))

    def size_for(self, batch: int) -> int:
        """The padded batch size a step of ``batch`` sequences runs at."""
        if not 0 < batch <= self.max_batch:
            raise ValueError(f"a decode step holds 1 to {self.max_batch} sequences; got {batch}")
        return next(s for s in self.sizes if s >= batch)

    def _size_for(self, batch: int, advance: bool, lora: bool) -> int:
        """:meth:`size_for` a step about to run (its buffers not yet filled); batch 1 at the next size for a compiled
        variant whose graph does not serve one sequence (:meth:`_settle_size_one`, once per variant). ``lora``: the
        variant's, read for batch 1 only."""
        variant = (advance, lora)
        if batch == 1 and self.compiled and self.agree is None and len(self.sizes) > 1:
            if variant not in self._size_one:
                self._size_one[variant] = self._settle_size_one(advance, lora)
            if self._size_one[variant] is not None:
                return self.sizes[1]
        return self.size_for(batch)

    def _settle_size_one(self, advance: bool, lora: bool) -> str | None:
        """Why the compiled step's graph of this variant cannot serve one sequence, or None. Traced at one, it would
        be specialised to one (a second graph for every other size); traced at more, a model's own code may still
        specialise size 1 (Llama 4's rotary ``torch.polar``, Qwen3.5's M-RoPE and Gemma 4's per-layer inputs guard on
        the batch being at least 2, in views inductor checks for overlap). So the graph is traced at the next size,
        on padding rows, then size 1 is tried on it without compiling; where it would compile again, steps of one
        sequence run at the next size (one padding row). Not under tensor parallelism, where every rank must run the
        same forwards: there the first size traced decides."""
        if (advance, lora) not in self._traced:
            self._pad_rows()
            self._step(self.sizes[1], advance, lora)  # traced, not captured
        if not self.compiled:  # compiling failed: every size runs eagerly
            return None
        self._pad_rows()
        args = self._step_args(1, advance, lora)
        mark_step_dynamic(args[1], self.runner.pool)
        return recompile_reason(self._step_fn, *args)

    # ---------------------------------------------------------------------------------- host-fed steps
    def run(
        self,
        seq_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        starts: Sequence[int],
        num_new: Sequence[int] | None = None,
        *,
        lora_slots: Sequence[int] | None = None,
        draw: Sequence[SampleRow] | None = None,
    ) -> torch.Tensor:
        """Logits of the new tokens, packed as ``input_ids [T]`` is: ``num_new[i]`` tokens of sequence
        ``seq_ids[i]`` from position ``starts[i]`` (default one each: ``[B, V]``); ``lora_slots[i]``: the LoRA slot
        of sequence ``i`` (-1: none). With ``draw`` (``draws`` steps; one row per sequence, each of
        :func:`~hfaccel.sampling.sampler.draws_in_step`), each sequence's next token drawn inside the step instead:
        ``[B]`` int64, what ``sample`` gives for those rows."""
        batch = len(seq_ids)
        size = self._size_for(batch, advance=False, lora=batch == 1 and lora_slots is not None and lora_slots[0] >= 0)
        num_new = [1] * batch if num_new is None else list(num_new)
        if draw is not None and (not self.draws or len(draw) != batch):
            raise ValueError(
                f"draw needs steps made with draws=True and one row per sequence; got {len(draw)} rows "
                f"for {batch} sequences" + ("" if self.draws else " and steps without draws")
            )
        mirror = self._mirrors(batch, size)
        start = time.perf_counter()
        self._held = max(first + n for first, n in zip(starts, num_new))
        self.buffers.fill(seq_ids, starts, size, num_new, draw_columns(draw) if draw is not None else [], mirror=mirror)
        lora = self.buffers.fill_lora(lora_slots, size, mirror)
        self.runner.metadata_seconds += time.perf_counter() - start
        self._size = None
        if self.tokens_per_seq == 1:
            self.buffers.set_tokens(input_ids, mirror)
            out = self._replay(size, advance=False, lora=lora, draw=draw is not None)[:batch]
            return out.clone() if draw is not None else out  # tokens outlive the next replay (async scheduling)
        q = self.tokens_per_seq
        where = to_device([i * q + j for i, n in enumerate(num_new) for j in range(n)], torch.long, self.device)
        self.buffers.set_tokens(input_ids, mirror, where, size)
        logits = self._replay(size, advance=False, lora=lora)  # [size, V] (last_only) or [size * q, V]
        return logits[:batch] if self.last_only else logits[where]

    def run_packed(self, input_ids: torch.Tensor, step: PackedStep) -> torch.Tensor:
        """Logits ``[B, V]`` of a decode step whose metadata is given (one token per sequence: ``input_ids [B]``,
        ``step`` on the device, its block tables at most as wide as the steps'): what every rank of an engine under
        tensor parallelism runs, the leader's step as it was broadcast. The rows beyond ``B`` are padding, as in
        :meth:`run`; the block tables' columns past the given width are never read (the lengths stop before)."""
        batch, width = input_ids.shape[0], step.block_tables.shape[1]
        if self.tokens_per_seq != 1 or step.max_q_len != 1 or step.positions.shape[0] != batch:
            raise ValueError(
                f"run_packed takes one token per sequence; got {step.positions.shape[0]} tokens for "
                f"{batch} sequences (max_q_len {step.max_q_len}) on steps of {self.tokens_per_seq}"
            )
        if width > self.buffers.block_tables.shape[1]:
            raise ValueError(f"block tables {width} blocks wide exceed the steps' {self.buffers.block_tables.shape[1]}")
        size = self._size_for(batch, advance=False, lora=False)
        self._held = step.max_seq_len
        self.buffers.input_ids[:batch].copy_(input_ids)
        self.buffers.positions[:size].zero_()[:batch].copy_(step.positions)
        self.buffers.seq_lens[:size].zero_()[:batch].copy_(step.seq_lens)
        self.buffers.slot_mapping[0, :size].fill_(-1)[:batch].copy_(step.slot_mapping.reshape(-1))
        self.buffers.block_tables[:batch, :width].copy_(step.block_tables)
        offsets = self.buffers.position_offsets[:size].zero_()
        if step.offsets is not None:
            offsets[:batch].copy_(step.offsets)
        self._size = None
        return self._replay(size, advance=False)[:batch]

    # ------------------------------------------------------------------------------- device-fed steps
    def begin(self, seq_ids: Sequence[Hashable], starts: Sequence[int]) -> None:
        """Set up steps in which sequence ``seq_ids[i]`` decodes positions ``starts[i]``, ``starts[i] + 1``, ...
        (:meth:`advance` runs them). Their blocks must already cover every position those steps will reach."""
        if self.tokens_per_seq != 1:
            raise RuntimeError(f"device-fed steps run one token per sequence; these steps take {self.tokens_per_seq}")
        size = self._size_for(len(seq_ids), advance=True, lora=False)
        self._mirror = self._mirrors(len(seq_ids), size)
        self.buffers.fill(seq_ids, starts, size, [1] * len(seq_ids), mirror=self._mirror)
        self._size, self._held = size, max(starts) + 1

    def advance(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the next step begun by :meth:`begin` (``input_ids [B]``, on the device)."""
        if self._size is None:
            raise RuntimeError("DecodeGraphs.advance needs begin() first (and no run() in between)")
        batch = input_ids.shape[0]
        self.buffers.set_tokens(input_ids, self._mirror)
        logits = self._replay(self._size, advance=True)[:batch]
        self._held += 1
        return logits

    # --------------------------------------------------------------------------------------- internals
    def _mirrors(self, batch: int, size: int) -> bool:
        """Whether a step of ``batch`` sequences run at ``size`` fills a mirror row: one sequence padded to the next
        size on a model that routes tokens to experts (module docstring)."""
        return self.mirror_padding and batch == 1 and size > 1

    def _step(self, size: int, advance: bool, lora: bool = False, draw: bool = False) -> torch.Tensor:
        """One static step of ``size`` sequences (:func:`static_step` on the buffers' leading rows; ``lora``: with
        the LoRA index buffer), then with ``draw`` the rows' tokens (:func:`draw_step` on the draw columns)."""
        logits = self._compiled(self._step_fn, *self._step_args(size, advance, lora))
        self._traced.add((advance, lora))
        return self._compiled(self._draw_fn, logits, self.buffers.draw_columns[:, :size]) if draw else logits

    def _step_args(self, size: int, advance: bool, lora: bool) -> tuple:
        """:func:`static_step`'s arguments for a step of ``size`` sequences."""
        rows = self.buffers.rows(size)
        context = self.max_model_len
        if self.runner.context_reason is not None:
            context = min(context_bucket(self._held, whole=False, model=self.runner.model), context)
        return self.runner, rows, advance, context, self.tokens_per_seq, lora, self.mirror_padding

    def _compiled(self, function, *args) -> torch.Tensor:
        """``function`` (the step or the draw, compiled or not) on ``args``, the dimensions that vary marked
        dynamic. If torch.compile cannot compile it (the recompile limit included), it says why once and runs
        uncompiled from then on (the step and the draw each on their own)."""
        if function is static_step or function is draw_step:
            return function(*args)
        is_step = function is self._step_fn
        if is_step:
            mark_step_dynamic(args[1], self.runner.pool)
        else:
            mark_draw_dynamic(*args)
        try:
            return compiled_call(function, *args)
        except compat.compile_errors() as error:
            reason = failure_reason(error)
            _log.warning(
                "hfaccel: torch.compile could not compile the decode step%s (%s); %s uncompiled",
                "" if is_step else "'s draw",
                reason,
                "decode steps run" if is_step else "it runs",
            )
            if is_step:
                self.compile_failure, self._step_fn, self.compiled = reason, static_step, False
                return static_step(*args)
            self.draw_compile_failure, self._draw_fn = reason, draw_step
            return draw_step(*args)

    def _replay(self, size: int, advance: bool, lora: bool = False, draw: bool = False) -> torch.Tensor:
        key = (size, advance, lora, draw)
        if not self.capture or key in self.capture_failures:
            return self._step(size, advance, lora, draw)
        if key not in self._graphs and not self._capture(size, advance, lora, draw):
            return self._step(size, advance, lora, draw)  # uncaptured: eager from now on
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self, size: int, advance: bool, lora: bool = False, draw: bool = False) -> bool:
        """Capture the step of ``size`` rows as a CUDA graph; whether it was captured. Triton and inductor compile in
        a first run before the capture, made on padding rows (they read no sequence's K/V or state and write only
        scratch): the capture records without running, so the rows' step then runs once, by the replay — their
        recurrent state and a device-fed step's counters move on once. A failed capture leaves this size
        uncaptured, with its reason."""
        self.buffers.rows(size)  # views made on the current stream, before the side stream
        filled = self.buffers.snapshot()
        self.buffers.pad()
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._step(size, advance, lora, draw)
        current.wait_stream(stream)
        self.buffers.restore(filled)
        graph, reason = torch.cuda.CUDAGraph(), None
        try:
            with torch.cuda.graph(graph, pool=self._memory_pool):
                captured = self._step(size, advance, lora, draw)
        except Exception as error:  # a forward that cannot be captured at this size: eager here, say why
            reason = failure_reason(error)
            release_generator_from_capture(self.device)
        if self.agree is not None and not self.agree(reason is None) and reason is None:
            reason = "another tensor-parallel rank could not capture this size"  # none replays: collectives pair up
        if reason is not None:
            self.capture_failures[(size, advance, lora, draw)] = reason
            _log.warning(
                "hfaccel: CUDA graph capture of the decode step at batch %d failed (%s); that size runs uncaptured",
                size,
                reason,
            )
            torch.cuda.synchronize(self.device)
            return False
        self._memory_pool = graph.pool()
        self._graphs[(size, advance, lora, draw)] = (graph, captured)
        return True
