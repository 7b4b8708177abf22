"""The device side of the engine's steps: a scheduled step launched — its tokens put on the device, one packed forward
of its chunks, the sampling of every sequence whose last token it computed, queued without waiting — and, later,
collected: the host waits for its tokens, which the scheduler then takes (``Scheduler.update``).

Tokens still in flight (asynchronous scheduling: the previous step's, not on the host yet) are read from the previous
step's device tensor: into the forward's input, and into the penalties' counts. A decode step whose rows need only
their tokens draws them inside the runner's static step (``sampling.draw_step``).

One bad request never fails another: when a launch raises, each request's part is run alone, committing nothing, to
find the requests that fail by themselves (:meth:`StepExecutor._launch_isolating`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from hfaccel.device import to_device
from hfaccel.engine.prompt_logprobs import PendingPromptLogprobs, PromptRows
from hfaccel.engine.scheduler import Request, ScheduledChunk, Scheduler, SchedulerOutput, Sequence, Status, StepOutput
from hfaccel.lora import LoRAManager
from hfaccel.runner import ModelRunner
from hfaccel.runner.multimodal import EncoderCache, MediaOffsets
from hfaccel.sampling import SampledTokens, SampleRow, TokenCounts, draws_in_step, sample
from hfaccel.sampling.structured import AfterReasoning, Constraint, Grammars, apply_masks


@dataclass
class HostTimes:
    """Where the host's time went in the engine's steps since :meth:`reset` (or the engine's start), in seconds:
    ``scheduling`` (choosing the step's work), ``metadata`` (its inputs and the runner's per-step metadata: token
    ids, block tables, positions, slots), ``launch`` (queueing the forward and the sampling on the device, less the
    metadata; on a CPU, which computes as it queues, this holds the computation), ``waiting`` (for the device's
    tokens) and ``detokenizing`` (stop checks, detokenization and freeing). ``hfaccel bench engine --host``
    reports them per step."""

    runner: ModelRunner
    steps: int = 0
    scheduling: float = 0.0
    inputs: float = 0.0  # the engine's share of the metadata (the runner's share is counted by the runner)
    launch: float = 0.0  # including the metadata
    waiting: float = 0.0
    detokenizing: float = 0.0
    masks: float = 0.0  # structured outputs' masks: filled on the host and queued (a part of ``launch``)

    def reset(self) -> None:
        self.steps = 0
        for part in ("scheduling", "inputs", "launch", "waiting", "detokenizing", "masks"):
            setattr(self, part, 0.0)
        self.runner.metadata_seconds = 0.0

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the time the ``with`` block takes to ``part``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - start)

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each part (``metadata`` split out of ``launch``)."""
        metadata = self.inputs + self.runner.metadata_seconds
        parts = {
            "scheduling": self.scheduling,
            "metadata": metadata,
            "launch": self.launch - metadata,
            "waiting": self.waiting,
            "detokenizing": self.detokenizing,
        }
        return {name: seconds * 1e3 / max(self.steps, 1) for name, seconds in parts.items()}


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device; its tokens reach the host later."""

    chunks: list[ScheduledChunk]
    targets: list[Sequence]  # the sequences that sampled, in the order of ``sampled``'s rows
    sampled: SampledTokens | None
    prompt: PendingPromptLogprobs | None = None  # prompt logprobs the step computed

    def __post_init__(self):
        self.row_of = {seq.seq_id: row for row, seq in enumerate(self.targets)}

    def sequences(self) -> list[Sequence]:
        return [chunk.seq for chunk in self.chunks] + self.targets

    def tokens(self, rows: list[int]) -> torch.Tensor:
        """The sampled tokens of ``rows`` (``-1`` for a row of -1), gathered on the device: ``[len(rows)]``."""
        index = to_device(rows, torch.long, self.sampled.tokens.device)
        if min(rows) >= 0:  # the decode inputs: a plain gather
            return self.sampled.tokens[index]
        return torch.where(index >= 0, self.sampled.tokens[index.clamp(min=0)], -1)


class StepExecutor:
    """Launches the engine's scheduled steps on the runner and collects them (module docstring).

    ``new_sequence``: makes a request's sibling completions when its prompt is computed (``Intake.new_sequence``);
    ``grammars``: the engine's structured-output grammars; ``async_scheduling``: each step's tokens start their copy
    to the host as soon as they are sampled.
    """

    def __init__(
        self,
        model,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        new_sequence: Callable[[Request, int, list[int]], Sequence],
        grammars: Callable[[], Grammars],
        token_counts: TokenCounts,
        loras: LoRAManager | None,
        media_offsets: MediaOffsets,
        encoder_cache: EncoderCache,
        host_times: HostTimes,
        async_scheduling: bool,
    ):
        self.model, self.runner, self.scheduler = model, runner, scheduler
        self.new_sequence, self.grammars, self.token_counts = new_sequence, grammars, token_counts
        self.loras, self.media_offsets, self.encoder_cache = loras, media_offsets, encoder_cache
        self.host_times, self.async_scheduling = host_times, async_scheduling
        self.in_flight: deque[Launched] = deque()  # launched steps not collected yet, oldest first

    def run(self, plan: SchedulerOutput) -> tuple[Launched | None, list[Request]]:
        """Launch the plan's step (its copy-on-write copies first) and queue it in :attr:`in_flight`. Returns the
        step launched — None without chunks, or when a hybrid model's other sequences are recomputed after a
        request failed alone (:meth:`_launch_isolating`) — and the requests failed alone."""
        if not plan.chunks:
            return None, []
        self.runner.pool.copy_blocks(plan.copies)
        chunks = sorted(plan.chunks, key=_prefills_images)  # the packed forward's chunks first (_forward)
        launched, failed = self._launch_isolating(chunks)
        self.host_times.steps += 1
        if launched is not None:
            self.in_flight.append(launched)
        return launched, failed

    def collect(self, launched: Launched) -> StepOutput | None:
        """A launched step's prompt logprobs filled in and its sampled tokens on the host (the host waits here for the
        device, once per step); None when its sequences all stopped or were aborted meanwhile: nothing to wait
        for."""
        if not any(seq.status is not Status.FINISHED for seq in launched.sequences()):
            return None
        with self.host_times.timed("waiting"):
            if launched.prompt is not None:
                launched.prompt.fill()
            tokens, logprobs = launched.sampled.result() if launched.sampled is not None else ([], [])
        return StepOutput(launched.chunks, launched.targets, tokens, logprobs)

    # ------------------------------------------------------------------------------------------- failures
    def _launch_isolating(self, chunks: list[ScheduledChunk]) -> tuple[Launched | None, list[Request]]:
        """Launch the step. If it raises, run each request's part alone (committing nothing) to find the
        requests whose part fails by itself: those are failed alone and the others launched again without them.
        A failure that is not theirs — every part fails alone, or none does (out of memory) — is raised, and the
        step changes nothing. A model whose layers keep recurrent state cannot write its state twice: there the
        step's other sequences are computed again from their tokens instead (``Scheduler.recompute``)."""
        try:
            return self._launch(chunks), []
        except Exception:
            requests = {chunk.seq.request for chunk in chunks}
            failures = self._failing_alone(chunks) if len(requests) > 1 else {}
            if not 0 < len(failures) < len(requests):
                self._recompute_states(chunks)
                raise
        for request, error in failures.items():
            self.scheduler.fail(request, error)
        rest = [chunk for chunk in chunks if chunk.seq.request not in failures]
        if self.runner.pool.states is not None:
            self._recompute_states(rest)
            return None, list(failures)
        return self._launch(rest), list(failures)

    def _recompute_states(self, chunks: list[ScheduledChunk]) -> None:
        """After a step that did not count, the sequences whose recurrent state its forwards may have advanced are
        computed again from their tokens (a model without recurrent state rewrites the same K/V: nothing to do)."""
        if self.runner.pool.states is not None:
            for chunk in chunks:
                self.scheduler.recompute(chunk.seq)

    def _failing_alone(self, chunks: list[ScheduledChunk]) -> dict[Request, Exception]:
        """The requests whose chunks' forward and sampling raise when run alone, and their errors. Nothing is
        committed: the K/V the forwards write are written again by the step that counts (recurrent state is
        recomputed: :meth:`_launch_isolating`), and a seeded row's noise depends only on its key (seed, completion,
        token index), so a trial draw changes nothing."""
        by_request: dict[Request, list[ScheduledChunk]] = {}
        for chunk in chunks:
            by_request.setdefault(chunk.seq.request, []).append(chunk)
        failures = {}
        for request, own in by_request.items():
            try:
                logits = self._forward(own)
                completing = [chunk.seq for chunk in own if chunk.completes]
                if completing:
                    self._sample(logits, list(range(len(completing))), completing)
            except Exception as error:
                failures[request] = error
        return failures

    # -------------------------------------------------------------------------------------------- launch
    def _launch(self, chunks: list[ScheduledChunk]) -> Launched:
        """Queue one packed forward of the chunks and the sampling of every sequence whose last token it
        computes; the step counts (computed tokens, forks, pending tokens) only once nothing can fail."""
        now = time.perf_counter()
        draw = self._draw_in_step(chunks)
        prompt = None
        if draw is not None:  # the decode step draws the tokens itself: [C]
            targets, children = [chunk.seq for chunk in chunks], []
            sampled = SampledTokens(self._forward(chunks, draw=draw))
        else:
            prompt_rows = PromptRows.of(chunks)
            logits = self._forward(chunks, prompt_rows=prompt_rows)  # [C (+ P), V]: a row per completing chunk
            completing = sum(chunk.completes for chunk in chunks)
            if prompt_rows is not None:  # then the rows that give prompt logprobs
                prompt = prompt_rows.logprobs(logits[completing:])
            targets, rows, children = self._targets([c for c in chunks if c.completes])
            sampled = self._sample(logits[:completing], rows, targets) if targets else None
        if sampled is not None and self.async_scheduling:
            sampled.start_copy()
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
            if chunk.seq.request.metrics.first_scheduled_time is None:
                chunk.seq.request.metrics.first_scheduled_time = now
        for parent, child in children:
            self._register_fork(parent, child)
        for seq in targets:
            seq.add_pending()
        return Launched(chunks, targets, sampled, prompt)

    def _forward(
        self, chunks: list[ScheduledChunk], draw: list[SampleRow] | None = None, prompt_rows: PromptRows | None = None
    ) -> torch.Tensor:
        """Logits ``[C, V]`` of the completing chunks' last tokens, after one packed forward of all chunks (with
        ``draw``, one row per chunk: the tokens drawn inside the decode step instead, ``[C]``; with
        ``prompt_rows``, their logits after those). Chunks that prefill a prompt with images come last (the
        step sorts them so): each runs the multimodal prefill of its own (their images encoded together where they
        stack), its row after the packed forward's."""
        with self.host_times.timed("inputs"):
            flat = [t for c in chunks for t in c.seq.token_ids[c.start : c.start + c.length]]
            input_ids = to_device([max(t, 0) for t in flat], torch.long, self.runner.device)  # [T]
            device_tokens = self._device_tokens(chunks)
            if device_tokens is not None:
                input_ids.index_copy_(0, *device_tokens)
        packed = [c for c in chunks if not _prefills_images(c)]
        for chunk in packed:
            self._continue_after_images(chunk)
        offset = sum(c.length for c in packed)
        prompt = [] if prompt_rows is None else prompt_rows.rows  # packed token indices, in chunk order
        logits = self._packed_forward(packed, input_ids[:offset], draw, [row for row in prompt if row < offset])
        if len(packed) == len(chunks):
            return logits
        rows, prompt_logits, completing = [], [], sum(c.completes for c in packed)
        with_images = chunks[len(packed) :]
        images = [(chunk, chunk.seq.request.media) for chunk in with_images]
        encoded = self.encoder_cache.inputs(
            self.model,
            [(m.digest, m.for_tokens(c.end), c.seq.token_ids[: c.end], m.units if m.spans else ()) for c, m in images],
        )
        for chunk, inputs in zip(with_images, encoded):
            media, end = chunk.seq.request.media, offset + chunk.length
            keep = [row - offset for row in prompt if offset <= row < end]
            slot = -1 if self.loras is None else self.loras.slot_of(chunk.seq.request.lora)
            past = chunk.seq.token_ids[: chunk.start]  # prefix-cache hits before its images
            out = self.runner.prefill_images(
                chunk.seq.seq_id, input_ids[offset:end], inputs, keep, lora_slot=slot, past_ids=past
            )
            rows.append(out[:1])  # [1, V]: its last token's
            prompt_logits.append(out[1:])  # [len(keep), V]
            self.media_offsets.record(media.digest, self.runner.position_offsets.get(chunk.seq.seq_id, 0))
            offset = end
        if logits is None:
            return torch.cat(rows + prompt_logits)
        return torch.cat([logits[:completing], *rows, logits[completing:], *prompt_logits])  # the prompt rows last

    def _continue_after_images(self, chunk: ScheduledChunk) -> None:
        """A sequence of a prompt with images that its own prefill did not compute (prefix-cache hits covered its
        images: the text after them runs in the packed forward) continues its positions at the offset its images
        gave."""
        media, seq_id = chunk.seq.request.media, chunk.seq.seq_id
        if media is None or seq_id in self.runner.position_offsets:
            return
        offset = self.media_offsets.get(media.digest)
        if offset:
            self.runner.position_offsets[seq_id] = offset

    def _packed_forward(
        self,
        chunks: list[ScheduledChunk],
        input_ids: torch.Tensor,
        draw: list[SampleRow] | None,
        prompt_rows: list[int],
    ) -> torch.Tensor | None:
        """The packed forward of ``chunks`` (what :meth:`_forward` returns for them, ``prompt_rows`` the packed
        token indices whose logits follow; None for no chunk)."""
        if not chunks:
            return None
        completing = [i for i, c in enumerate(chunks) if c.completes]
        lora_slots = None if self.loras is None else [self.loras.slot_of(c.seq.request.lora) for c in chunks]
        return self.runner.forward(
            [c.seq.seq_id for c in chunks],
            input_ids,
            [c.length for c in chunks],
            starts=[c.start for c in chunks],
            logits_for=completing,
            lora_slots=lora_slots,
            draw=draw,
            prompt_rows=prompt_rows or None,
        )

    def _device_tokens(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions [F], tokens [F])`` in the packed input of the tokens still in flight (sampled by the
        step before, read from its device tensor), or None when the host knows every token."""
        positions, sources, offset = [], [], 0
        for chunk in chunks:
            seq = chunk.seq
            for pos in range(max(chunk.start, seq.num_known_tokens), chunk.start + chunk.length):
                assert seq.num_pending == 1, "a sequence has one token in flight at most when it is scheduled"
                positions.append(offset + pos - chunk.start)
                sources.append(self.in_flight[-1].row_of[seq.seq_id])
            offset += chunk.length
        if not positions:
            return None
        device = self.runner.device
        return to_device(positions, torch.long, device), self.in_flight[-1].tokens(sources)

    def _register_fork(self, parent: Sequence, child: Sequence) -> None:
        self.runner.fork(parent.seq_id, child.seq_id)
        child.num_computed = parent.num_computed
        parent.request.forked = True
        parent.request.seqs.append(child)
        self.scheduler.add_running(child)

    # ------------------------------------------------------------------------------------------- sampling
    def _draw_in_step(self, chunks: list[ScheduledChunk]) -> list[SampleRow] | None:
        """The sampling rows of a decode step whose tokens the step can draw itself, or None: every chunk one
        token of a sequence already forked, no row needing more than its token (``draws_in_step``), some row
        sampling (an all-greedy step takes the argmax of the logits, cheaper than the draw's sort)."""
        seqs = [chunk.seq for chunk in chunks]
        params = [seq.request.params for seq in seqs]
        if not (
            all(draws_in_step(p) for p in params)
            and not all(p.greedy for p in params)
            and not any(map(_prefills_images, chunks))
            and all(chunk.completes and chunk.seq.request.forked for chunk in chunks)
            and self.runner.draws(
                [chunk.length for chunk in chunks], list(range(len(chunks))), [chunk.start for chunk in chunks]
            )
        ):
            return None
        return _sample_rows(seqs)

    def _targets(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[Sequence], list[int], list[tuple[Sequence, Sequence]]]:
        """The sequences that sample from the completing chunks' logits and the logits row of each: a chunk's
        own sequence, plus its n - 1 siblings the first time its prompt is computed (made here; they share its
        blocks once ``_register_fork`` runs)."""
        targets, rows, children = [], [], []
        for row, chunk in enumerate(chunks):
            seq, request = chunk.seq, chunk.seq.request
            family = [seq]
            if not request.forked:
                family += [
                    self.new_sequence(request, index, list(seq.token_ids)) for index in range(1, request.params.n)
                ]
                children += [(seq, child) for child in family[1:]]
            targets += family
            rows += [row] * len(family)
        return targets, rows, children

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> SampledTokens:
        """Next tokens of ``seqs`` (``seqs[i]`` samples from ``logits[rows[i]]``), queued on the device."""
        if rows != list(range(logits.shape[0])):
            logits = logits[to_device(rows, torch.long, logits.device)]
        sample_rows = _sample_rows(seqs)
        pending = None  # the penalties count a token still in flight
        if any(row.params.penalized for row in sample_rows) and any(seq.num_pending for seq in seqs):
            previous = self.in_flight[-1]
            pending = previous.tokens([previous.row_of[s.seq_id] if s.num_pending else -1 for s in seqs])
        if any(seq.request.params.structured_outputs is not None for seq in seqs):
            with self.host_times.timed("masks"):
                logits = apply_masks(logits, [self._constraint(seq) for seq in seqs])
        return sample(logits, sample_rows, pending, self.token_counts)

    def _constraint(self, seq: Sequence) -> Constraint | AfterReasoning | None:
        """The sequence's place in its grammar (None: unconstrained); made at its first draw."""
        spec = seq.request.params.structured_outputs
        if spec is not None and seq.constraint is None:
            seq.constraint = self.grammars().constraint(spec)
        return seq.constraint


def _sample_rows(seqs: list[Sequence]) -> list[SampleRow]:
    """What the sampler needs of each sequence: its params, seed and stream, the index of the token it draws
    now (tokens in flight counted), and the stop tokens it may not draw yet (below its ``min_tokens``)."""
    rows = []
    for seq in seqs:
        counter = len(seq.output.token_ids) + seq.num_pending
        banned = sorted(seq.stopper.stop_token_ids) if counter < seq.stopper.min_tokens else ()
        rows.append(
            SampleRow(
                seq.request.params,
                seq.seed,
                seq.request.prompt_token_ids,
                seq.output.token_ids,
                counter=counter,
                stream=seq.index,
                key=seq.seq_id,
                banned=banned,
            )
        )
    return rows


def _prefills_images(chunk: ScheduledChunk) -> bool:
    """Whether a chunk computes a prompt's images (the multimodal prefill: from its first token, or from its
    prefix-cache hits before them)."""
    return chunk.seq.request.media is not None and chunk.seq.request.media.images_from(chunk.start)
