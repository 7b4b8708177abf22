"""The static step a :class:`~hfaccel.runner.graphs.DecodeGraphs` runs, and what compiling and capturing it needs:
the dimensions marked dynamic, a code object per compiled copy, a failure's reason in one line, and the generator a
failed capture leaves behind."""

from __future__ import annotations

import logging
import threading
import types
from typing import TYPE_CHECKING

import torch

from hfaccel import compat
from hfaccel.kv import KVPool, PackedStep, slot_mapping
from hfaccel.kv.state import StateStep

if TYPE_CHECKING:
    from hfaccel.runner.runner import ModelRunner

_log = logging.getLogger("hfaccel")
POOL_BLOCKS_DIM = 2  # the block dimension of a KV pool ``[L, 2, num_blocks, block_size, Hkv, D]``


def static_step(
    runner: ModelRunner,
    rows: tuple[torch.Tensor, ...],
    advance: bool,
    max_model_len: int,
    tokens_per_seq: int = 1,
    lora: bool = False,
    mirror: bool = False,
) -> torch.Tensor:
    """One static step over the static buffers' leading rows ``rows`` (``StepBuffers.rows``): with ``advance``
    (one token per sequence), this step's slots from positions and block tables first (device-fed), and positions
    and lengths moved on after the forward; with ``lora``, each token's LoRA slot from its buffer; with ``mirror``
    (steps that may hold a mirror row), a row that writes no K/V stores its recurrent state to the scratch slot.
    Returns the logits of the ``keep`` tokens: ``[size * tokens_per_seq, V]`` (every token) or ``[size, V]`` (each
    sequence's last)."""
    input_ids, positions, seq_lens, slots, tables, cu_seqlens, keep, index, lora_index, state_slots, offsets = rows
    writes = slots[0] >= 0  # [T]: the tokens that write (not a padding row's, nor a mirror row's: DecodeGraphs)
    if advance:  # a fresh tensor, not written into the slot buffer: the kernels read this step's slots
        slots = torch.where(writes, slot_mapping(tables, index, positions, runner.pool.block_size), -1)[None]
    state = None
    if runner.pool.states is not None:
        scratch = runner.pool.states.scratch
        stores = torch.where(writes.view(-1, tokens_per_seq)[:, 0], state_slots, scratch) if mirror else None
        state = StateStep(state_slots, stores=stores)
    step = PackedStep(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens,
        positions=positions,
        max_seq_len=max_model_len,
        max_q_len=tokens_per_seq,
        state=state,
        offsets=offsets if runner.offsets_positions else None,
    )
    logits = runner.run_model(input_ids, step, keep, lora_index if lora else None)
    if advance:
        live = (seq_lens > 0).to(seq_lens.dtype)
        positions.add_(live)
        seq_lens.add_(live)
    return logits


def mark_step_dynamic(rows: tuple[torch.Tensor, ...], pool: KVPool) -> None:
    """Mark the dimensions of a step's inputs that vary between calls as dynamic for torch.compile: the rows' batch
    dimension (tokens or sequences), the pool's block count and its state slots. Everything else stays static
    (``dynamic=None``)."""
    input_ids, positions, seq_lens, slots, tables, cu_seqlens, keep, index, lora_index, state_slots, offsets = rows
    for tensor in (input_ids, positions, seq_lens, tables, cu_seqlens, keep, index, lora_index, state_slots, offsets):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    torch._dynamo.maybe_mark_dynamic(slots, 1)
    for tensor in pool.tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, POOL_BLOCKS_DIM)
    for tensor in pool.states.tensors() if pool.states is not None else ():
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def mark_draw_dynamic(logits: torch.Tensor, columns: torch.Tensor) -> None:
    """Mark a draw's rows (``logits [R, V]``, ``columns [C, R]``) dynamic for torch.compile, the rest static."""
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(columns, 1)


# held by every call of a compiled step and by a recompile probe: torch's compile stance is process-wide, so no
# other thread's compiled step runs (and compiles) while a probe forbids compiling
_COMPILED_CALLS = threading.RLock()


def compiled_call(compiled, *args):
    """``compiled(*args)`` (a :func:`compiled_function`, its dimensions marked dynamic) as every compiled step runs:
    sizes marked dynamic traced as symbols (:func:`hfaccel.compat.marked_sizes_only`), no probe running meanwhile."""
    with _COMPILED_CALLS, compat.marked_sizes_only():
        return compiled(*args)


def recompile_reason(compiled, *args) -> str | None:
    """Why ``compiled`` would compile again to run on ``args`` — the guard that fails, in one line — or None when a
    graph it holds serves them, which then ran. While it tries, torch's stance forbids compiling in the whole
    process; hfaccel's own compiled calls wait for it (:func:`compiled_call`), a user's own ``torch.compile`` in
    another thread would see the stance."""
    try:
        with _COMPILED_CALLS, torch.compiler.set_stance("fail_on_recompile"):
            compiled_call(compiled, *args)
    except Exception as error:  # the stance's RuntimeError, or the step failing at this size: either way not served
        guards = [
            line.strip()[2:].split(": ", 1)[-1] for line in str(error).splitlines() if line.strip().startswith("- ")
        ]
        sized = [guard for guard in guards if ".size()" in guard]  # the batch's, before another variant's
        return f"the model's code specialises it: {(sized or guards)[0][:300]}" if guards else failure_reason(error)
    return None


def failure_reason(error: BaseException) -> str:
    """A fallback's reason in one line: the error's type and the first line of its message (at most 300 chars).
    Where ``error`` was raised while handling another (a failed capture's ``capture_end`` reports only "operation
    failed due to a previous error during capture", hiding the error inside the captured step), the first error
    of the chain leads — that is the cause — and ``error`` follows it."""
    first = error
    seen = {id(error)}
    while (cause := first.__cause__ or first.__context__) is not None and id(cause) not in seen:
        first = cause
        seen.add(id(cause))
    return _one_line(error) if first is error else f"{_one_line(first)}; then {_one_line(error)}"


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def release_generator_from_capture(device: torch.device) -> None:
    """Take ``device``'s default CUDA generator out of capture mode after a capture that failed: ``torch.cuda.graph``
    puts it back only when ``capture_end`` succeeds, and until then every random op on the device fails
    (docs/benchmarks.md). A capture that succeeds puts it back: one of a single fill, on a side stream."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    try:
        with torch.cuda.stream(stream):
            scratch = torch.empty(1, device=device)
            with torch.cuda.graph(graph, stream=stream):
                scratch.fill_(0.0)
        torch.cuda.current_stream(device).wait_stream(stream)
    except Exception as error:  # the device is in no state to capture at all: say so, keep the first failure's reason
        _log.warning(
            "hfaccel: after a failed CUDA graph capture, the generator of %s could not be released (%s); "
            "random ops on it may fail",
            device,
            failure_reason(error),
        )


def compiled_function(function):
    """``function`` under ``torch.compile(fullgraph=True)`` (inductor, :func:`hfaccel.compat.inductor_backend`), from
    a code object of its own; static except the dimensions marked dynamic before each call."""
    return torch.compile(_own_code(function), fullgraph=True, dynamic=None, backend=compat.inductor_backend)


def _own_code(function):
    """A copy of ``function`` with a code object of its own. Dynamo keeps compiled variants per code object and
    counts them against one recompile limit (8): each DecodeGraphs compiles its own copy, so the runners of a
    process (several models, engines, a pool that grew) never share it."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
