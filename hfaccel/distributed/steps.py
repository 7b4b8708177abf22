"""The engine under tensor parallelism: the leader (TP rank 0) schedules, samples and owns every request; each of its
packed forwards goes to the other ranks as ONE broadcast of one packed int64 tensor — token ids, positions, slot
mapping, block tables, sequence lengths, the logits rows to keep, and the copy-on-write block copies queued since the
last forward — and the followers run the same forward on their shard of the model (transformers' hooks all-reduce
between the ranks inside it) and their pool of their local KV heads. The followers never sample: a token the
leader sampled reaches them as an input id of the next step, so every rank computes on the same tokens.

The seam is the runner's forward with its metadata built: :class:`LeaderRunner` broadcasts there (its
``_eager_forward`` and ``_static_forward``), :func:`follow` runs the same there (``run_model`` and the static
steps). A decode step the static steps serve (compiled and CUDA-graph captured on CUDA) goes out the same way,
marked static: the leader builds its metadata on the host (not on the device from its tables, as one process
does), and every rank runs it through its own static steps
(:meth:`~hfaccel.runner.graphs.DecodeGraphs.run_packed`) — the same padded size on every rank, so the collectives
inside the captured graphs pair up; the engine builds (and warms up) the same steps on every rank.

A prompt with images is prefilled through transformers' own forward (the vision encoder, the merge of its features),
so its message carries that forward's inputs: its tokens, its block table and the model's multimodal inputs (pixels,
or the leader's encoded images), in a broadcast of their own (:meth:`TensorParallel.broadcast_tree`). Where images
move the positions of the text after them (Qwen's M-RoPE), each later step carries its tokens' position offsets.
A forward may raise on every rank alike (a prompt whose images do not match its placeholders: the leader fails that
request alone and the ranks go on), or on some ranks only (out of memory), which leaves the others inside a collective
of the forward or waiting for the next step. So a rank whose forward raised settles it with the others
(:meth:`StepChannel.settle`) in a group of their own whose wait is bounded: every rank raised, and each goes on;
otherwise it ends (:class:`TensorParallelError`) instead of leaving the ranks waiting on each other. A forward that
succeeds settles nothing: no step pays for this.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfaccel.device import raise_if_lost
from hfaccel.distributed.model import TensorParallel
from hfaccel.kv import KVPool, PackedStep
from hfaccel.kv.block_manager import BlockCopy
from hfaccel.kv.fp8 import KVScales
from hfaccel.runner import ModelRunner
from hfaccel.runner.graphs import DecodeGraphs
from hfaccel.runner.multimodal import prefill_on_blocks

_log = logging.getLogger("hfaccel")

# message kinds (the header's first value): an eager forward, block copies alone, the end, a static decode step, a
# prompt's multimodal prefill (its inputs follow in a broadcast of their own: StepChannel.send_prefill)
FORWARD, COPIES, STOP, STATIC, PREFILL = 0, 1, 2, 3, 4
# header: kind, tokens T, sequences S, table width W, kept logits K (-1: every row), copies C, max_seq_len, max_q_len,
# whether position offsets follow the positions (a multimodal model's text after images)
_HEADER = 9
# how long a rank whose forward raised waits for every other rank's to have raised too (they get there together)
VERDICT_TIMEOUT = datetime.timedelta(minutes=2)


class TensorParallelError(BaseException):
    """The TP ranks no longer run the same forwards (a forward raised on some ranks only): nothing more can run on
    them, and every rank must be restarted. A ``BaseException``, as ``SystemExit`` is, so that the engine's handlers
    that fail one request and go on (``except Exception``) let it through: it ends the engine (``AsyncEngine.healthy``
    turns False) and the follower ranks' :func:`follow`."""


@dataclass(frozen=True)
class StepLimits:
    """The largest step the leader sends: what sizes every rank's message buffer."""

    max_tokens: int  # tokens per forward (the engine's max_num_batched_tokens)
    max_seqs: int  # sequences per forward (max_num_seqs)
    max_blocks: int  # blocks per sequence (ceil(max_model_len / block_size))

    @property
    def max_copies(self) -> int:
        return self.max_seqs  # more go ahead in messages of their own

    @property
    def size(self) -> int:
        """int64 values of one message."""
        return (
            _HEADER
            + 4 * self.max_tokens
            + self.max_seqs * self.max_blocks
            + 2 * self.max_seqs
            + 1
            + self.max_seqs
            + self.max_tokens  # kept rows: each sequence's last, then its prompt logprobs' rows
            + 2 * self.max_copies
        )


@dataclass
class Message:
    """One received message: block copies to make, then (``FORWARD``, ``STATIC``) a forward to run or (``PREFILL``)
    a prompt's multimodal prefill."""

    kind: int
    copies: list[BlockCopy]
    input_ids: torch.Tensor | None = None  # [T]
    step: PackedStep | None = None
    keep: torch.Tensor | int = 0  # [K] logits rows, or 0: every row
    prefill: dict | None = None  # a PREFILL's: its prompt's input_ids [L], block_table [W], keep, inputs, past_ids


class StepChannel:
    """The leader's broadcast of each step's inputs to the TP ranks, and the followers' receipt of them: one
    preallocated buffer of :attr:`StepLimits.size` int64 values on the model's device, one broadcast per message (a
    multimodal prefill's inputs follow its message in broadcasts of their own)."""

    def __init__(
        self,
        tp: TensorParallel,
        limits: StepLimits,
        device: torch.device,
        verdicts: dist.ProcessGroup | None = None,
    ):
        """``verdicts``: the group :meth:`settle` waits in, with a bounded timeout (:func:`verdict_group`; without
        one, a forward that raises breaks the channel)."""
        self.tp, self.limits, self.device, self.verdicts = tp, limits, device, verdicts
        self.buffer = torch.zeros(limits.size, dtype=torch.int64, device=device)  # [N]
        self.broken: TensorParallelError | None = None  # why the ranks cannot run the same forwards any more

    def send_forward(
        self,
        input_ids: torch.Tensor,
        step: PackedStep,
        keep: torch.Tensor | int,
        copies: Sequence[BlockCopy],
        *,
        static: bool = False,
    ) -> None:
        """Broadcast one forward (leader only): ``input_ids [T]`` and ``step`` on the device, ``keep`` as
        :meth:`ModelRunner.run_model` takes it, and the block copies to make first; ``static``: a decode step the
        static steps run (``keep`` 0)."""
        limits = self.limits
        copies = list(copies)
        while len(copies) > limits.max_copies:  # rare (many forks at once): the excess goes ahead alone
            self._send(COPIES, [], copies[: limits.max_copies])
            copies = copies[limits.max_copies :]
        tokens, (seqs, width) = input_ids.shape[0], step.block_tables.shape
        if tokens > limits.max_tokens or seqs > limits.max_seqs or width > limits.max_blocks:
            raise ValueError(
                f"a forward of {tokens} tokens, {seqs} sequences and {width} blocks per sequence exceeds "
                f"the TP step buffer ({limits.max_tokens} tokens, {limits.max_seqs} sequences, "
                f"{limits.max_blocks} blocks)"
            )
        kept = -1 if isinstance(keep, int) else keep.shape[0]
        header = [
            STATIC if static else FORWARD,
            tokens,
            seqs,
            width,
            kept,
            len(copies),
            step.max_seq_len,
            step.max_q_len,
            int(step.offsets is not None),
        ]
        parts = [
            input_ids,
            step.positions,
            step.slot_mapping.reshape(-1),
            step.block_tables.reshape(-1),
            step.seq_lens,
            step.cu_seqlens_q,
        ] + ([] if isinstance(keep, int) else [keep])
        self._send_parts(header, parts + ([] if step.offsets is None else [step.offsets]), copies)

    def send_prefill(
        self,
        input_ids: torch.Tensor,
        block_table: torch.Tensor,
        keep: Sequence[int],
        inputs: dict,
        copies: Sequence[BlockCopy],
        past_ids: Sequence[int] = (),
    ) -> dict:
        """Broadcast one prompt's multimodal prefill (leader only): its tokens ``input_ids [L]`` (any length: they
        travel with the inputs, not in the step buffer), its blocks ``block_table [W]``, the prompt rows whose
        logits it keeps, the model's multimodal ``inputs`` (pixels or encoded images, image sizes, token types...),
        the block copies to make first, and the tokens its blocks hold before ``input_ids`` (prefix-cache hits).
        Returns what every rank received (the tensors on the device): the leader prefills on the same."""
        copies = list(copies)
        while len(copies) > self.limits.max_copies:
            self._send(COPIES, [], copies[: self.limits.max_copies])
            copies = copies[self.limits.max_copies :]
        self._send(PREFILL, [], copies)
        return self.tp.broadcast_tree(
            {
                "input_ids": input_ids,
                "block_table": block_table,
                "keep": list(keep),
                "inputs": inputs,
                "past_ids": list(past_ids),  # plain ints, with the layout (no collective of its own)
            }
        )

    def send_stop(self) -> None:
        """Tell the followers the leader is done (leader only): their :func:`follow` returns. Not once the ranks
        diverged (:attr:`broken`): a follower is gone or inside a collective, and its launcher stops it."""
        if self.broken is None:
            self._send(STOP, [], [])

    def settle(self, error: Exception) -> None:
        """After a forward that raised ``error`` on this rank: returns once every rank's raised too (its inputs'
        error, which the leader raises for that request alone); raises :class:`TensorParallelError` and marks the
        channel :attr:`broken` when they do not all say so within :data:`VERDICT_TIMEOUT` (the others are inside a
        collective of the forward, waiting for the next step, or gone)."""
        failed = torch.ones(1, dtype=torch.int64)
        try:
            if self.verdicts is None:
                raise RuntimeError("the channel has no group to settle in")
            dist.all_reduce(failed, group=self.verdicts)  # completes only once every rank joined it
        except Exception as lost:  # gloo's timeout, or a peer's closed connection
            self.broken = TensorParallelError(
                f"TP rank {self.tp.rank}: a forward raised {error!r} here, and not every rank said it raised there "
                f"too within {VERDICT_TIMEOUT} ({lost}); the ranks no longer run the same forwards"
            )
            raise self.broken from error

    def _send(self, kind: int, parts: list[torch.Tensor], copies: list[BlockCopy]) -> None:
        self._send_parts([kind, 0, 0, 0, -1, len(copies), 0, 0, 0], parts, copies)

    def _send_parts(self, header: list[int], parts: list[torch.Tensor], copies: list[BlockCopy]) -> None:
        if self.broken is not None:
            raise self.broken
        values = [c.src for c in copies] + [c.dst for c in copies]
        head = torch.tensor(header + values, dtype=torch.int64).to(self.device, non_blocking=True)
        packed = torch.cat([head[:_HEADER]] + [p.to(torch.int64) for p in parts] + [head[_HEADER:]])  # [n]
        self.buffer[: packed.shape[0]] = packed
        self.tp.broadcast(self.buffer)

    def receive(self) -> Message:
        """The leader's next message (followers only; waits for it)."""
        self.tp.broadcast(self.buffer)
        kind, tokens, seqs, width, kept, copies, max_seq_len, max_q_len, offset = self.buffer[:_HEADER].tolist()
        forward = kind in (FORWARD, STATIC)
        sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1 if forward else 0, max(kept, 0)]
        sizes += [tokens * offset, copies, copies]
        (input_ids, positions, slots, tables, seq_lens, cu, keep, offsets, src, dst) = torch.split(
            self.buffer[_HEADER : _HEADER + sum(sizes)], sizes
        )
        moves = [BlockCopy(s, d) for s, d in zip(src.tolist(), dst.tolist())]
        if kind == PREFILL:
            return Message(kind, moves, prefill=self.tp.broadcast_tree())
        if not forward:
            return Message(kind, moves)
        step = PackedStep(
            slot_mapping=slots[None],
            block_tables=tables.view(seqs, width).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            cu_seqlens_q=cu.to(torch.int32),
            positions=positions,
            max_seq_len=max_seq_len,
            max_q_len=max_q_len,
            offsets=offsets if offset else None,
        )
        return Message(kind, moves, input_ids, step, keep if kept >= 0 else 0)


class LeaderPool(KVPool):
    """The leader's pool: the block copies it makes are also queued for the followers' pools (they go out with the
    next forward)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queued: list[BlockCopy] = []
        self.copies_made = 0  # block copies since the start (every one reaches the followers)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        super().copy_blocks(copies)
        self.queued.extend(copies)
        self.copies_made += len(copies)

    def take_queued(self) -> list[BlockCopy]:
        """The copies made since the last call (and forgets them)."""
        queued, self.queued = self.queued, []
        return queued


class LeaderRunner(ModelRunner):
    """The leader's runner: each forward's inputs are broadcast to the followers before it runs."""

    def __init__(self, model, pool: LeaderPool, channel: StepChannel):
        super().__init__(model, pool)
        self.channel = channel

    def _eager_forward(
        self, input_ids: torch.Tensor, step: PackedStep, keep: torch.Tensor | int, lora_index: torch.Tensor | None
    ) -> torch.Tensor:
        if lora_index is not None:
            raise NotImplementedError("LoRA adapters are not supported under tensor parallelism yet")
        self.channel.send_forward(input_ids, step, keep, self.pool.take_queued())
        return self._settled(self.run_model, input_ids, step, keep)

    def _static_forward(
        self,
        graphs: DecodeGraphs,
        seq_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        starts: Sequence[int],
        num_new: Sequence[int],
        extra: dict,
    ) -> torch.Tensor:
        """A decode step of the static steps: its metadata built here, broadcast marked static, then run through
        :meth:`DecodeGraphs.run_packed` as every follower does."""
        if extra or graphs is not self.graphs:
            raise NotImplementedError(
                "under tensor parallelism the static steps serve plain decode steps only (no "
                f"LoRA, in-step draw or catch-up steps); got {sorted(extra) or 'catch-up'}"
            )
        step = self._with_offsets(self.pool.packed_step(seq_ids, starts, num_new), seq_ids, num_new).to(self.device)
        self.channel.send_forward(input_ids, step, 0, self.pool.take_queued(), static=True)
        return self._settled(graphs.run_packed, input_ids, step)

    def prefill_images(
        self,
        seq_id: Hashable,
        input_ids: torch.Tensor,
        inputs: dict,
        keep: Sequence[int] = (),
        lora_slot: int = -1,
        past_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """A prompt's multimodal prefill: its tokens, blocks, inputs and the tokens held before them broadcast, then
        run as every follower runs it (:func:`~hfaccel.runner.multimodal.prefill_on_blocks`)."""
        if lora_slot >= 0:
            raise NotImplementedError("LoRA adapters are not supported under tensor parallelism yet")
        held, length = self.pool.manager.seq_len(seq_id), len(past_ids) + input_ids.shape[0]
        if held < length:  # what PromptCache would raise, raised before any rank starts
            raise ValueError(f"sequence {seq_id!r} holds {held} slots; its prompt has {length} tokens")
        table = self.pool.block_tables([seq_id])[0, : -(-held // self.pool.block_size)].to(self.device)  # [W]
        sent = self.channel.send_prefill(input_ids, table, keep, inputs, self.pool.take_queued(), past_ids)
        return self._settled(super().prefill_images, seq_id, input_ids, sent["inputs"], keep, -1, past_ids)

    def _settled(self, forward: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """``forward(*args)``, the forward every rank runs; if it raises, the error once every rank's raised too
        (:meth:`StepChannel.settle`)."""
        try:
            return forward(*args)
        except Exception as error:
            raise_if_lost(error, self.device)  # (the device fails every call: no verdict to wait for)
            self.channel.settle(error)
            raise


def tp_runner(
    model,
    tp: TensorParallel,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    kv_cache_dtype: torch.dtype | None = None,
    kv_scales: KVScales = None,
) -> tuple[ModelRunner, StepChannel]:
    """An engine's runner on a TP rank, and the channel its steps go through: on the leader a
    :class:`LeaderRunner` over a :class:`LeaderPool`; on a follower a plain runner for :func:`follow` (its pool's
    block manager stays unused: the leader's block tables come with each step)."""
    limits = StepLimits(max_num_batched_tokens, max_num_seqs, -(-max_model_len // block_size))
    channel = StepChannel(tp, limits, tp.device, verdict_group(tp))
    pool_class = LeaderPool if tp.is_leader else KVPool
    pool = pool_class.for_model(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_dtype=kv_cache_dtype,
        kv_scales=kv_scales,
    )
    runner = LeaderRunner(model, pool, channel) if tp.is_leader else ModelRunner(model, pool)
    return runner, channel


@torch.inference_mode()
def follow(runner: ModelRunner, channel: StepChannel) -> int:
    """Run the leader's forwards on this rank until it stops (its ``Engine.shutdown()``); returns how many ran. A
    forward that raises here is settled with the other ranks (:meth:`StepChannel.settle`): raised on every rank, the
    leader fails its request alone and this rank goes on; otherwise :class:`TensorParallelError`. An error the device
    keeps raises :class:`~hfaccel.device.DeviceLostError` at once."""
    forwards = 0
    while True:
        message = channel.receive()
        if message.copies:
            runner.pool.copy_blocks(message.copies)
        if message.kind == STOP:
            return forwards
        if message.kind == COPIES:
            continue
        try:
            _run(runner, message)
        except Exception as error:
            raise_if_lost(error, runner.device)  # (the device fails every call: no verdict to wait for)
            channel.settle(error)
            _log.warning("hfaccel: a forward raised on every TP rank (the leader fails its request): %s", error)
        forwards += 1


def _run(runner: ModelRunner, message: Message) -> None:
    """The forward ``message`` carries, run on this rank."""
    if message.kind == FORWARD:
        runner.run_model(message.input_ids, message.step, message.keep)
    elif message.kind == STATIC:  # the engine checked at start that every rank has the same static steps
        runner.graphs.run_packed(message.input_ids, message.step)
    else:
        prefill = message.prefill
        prefill_on_blocks(
            runner.model,
            runner,
            prefill["block_table"],
            prefill["input_ids"],
            prefill["inputs"],
            prefill["keep"],
            prefill["past_ids"],
        )


def verdict_group(tp: TensorParallel) -> dist.ProcessGroup:
    """A gloo group over the TP ranks whose collectives give up after :data:`VERDICT_TIMEOUT` (the model's own group
    waits a year for the next step): where :meth:`StepChannel.settle` waits. Every rank makes it, at the same point."""
    ranks = dist.get_process_group_ranks(tp.group)
    return dist.new_group(ranks, timeout=VERDICT_TIMEOUT, backend="gloo", use_local_synchronization=True)
