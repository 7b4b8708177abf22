"""Iteration-level scheduling: which tokens of which sequences the next forward computes.

Every step packs, within ``max_num_batched_tokens``:

1. the running sequences, oldest first: one decode token each (or the rest of a prefill chunk / recompute),
   growing their blocks; when the pool is out of blocks the newest running sequence is preempted (its blocks
   freed, to be recomputed from its tokens when it is admitted again) until the older one fits;
2. then waiting sequences, first come first served, while sequences and tokens remain in the budget and the pool has
   blocks for the whole prompt (after prefix-cache hits): a prompt longer than what is left of the budget is computed
   in chunks over several steps (chunked prefill), so running decodes never stall. A prompt with images (any prompt,
   under ``whole_prompts``: Mamba-1's layers restart a chunk) is computed in one step from its prefix-cache hits on
   (an image's tokens are never split), when the budget left holds what its hits leave (more than the whole budget
   goes past it, and so does one admitted in a step that raised, when the caller steps on and the sequences before it
   take more of the budget); hits end before an image (the text and images before it, shared with any prompt that has
   them: a chat's next turn adding an image) or cover all its images, and then the text after them is computed like
   any prompt's, at the position offset its images gave (``media_offsets``).

With LoRA adapters (a :class:`~hfaccel.lora.LoRAManager`), a waiting sequence whose adapter has no slot free
(``max_loras`` distinct adapters already run) is passed over for this step and waits at its place in the queue;
base-model sequences behind it may still be admitted, adapter ones wait too (else the adapters running could keep
their slots forever); a sequence holds a reference on its adapter's slot while it runs.
Its blocks are shared through the prefix cache only with sequences of the same adapter, and a prompt's blocks from
the one holding an image's first token on only with prompts of the same image there (``salts_from``).

After a step the scheduler takes its output (:meth:`Scheduler.update`): each sampled token is appended to its
sequence, stop rules applied, and finished sequences freed at once.

Plain Python over the engine's :class:`~hfaccel.kv.BlockManager`; nothing here touches tensors.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hfaccel.engine.outputs import CompletionOutput, RequestMetrics
from hfaccel.kv import BlockCopy, BlockManager, CacheFullError, PrefixHit
from hfaccel.sampling import IncrementalDetokenizer, SamplingParams, StopChecker, TokenLogprob
from hfaccel.sampling.structured import AfterReasoning, Constraint

if TYPE_CHECKING:
    from hfaccel.engine.media import MediaInputs
    from hfaccel.lora import LoRAAdapter, LoRAManager


PENDING = -1  # a sampled token the host does not know yet (asynchronous scheduling)
_SERIALS = itertools.count()  # each Request's number, never reused in the process (a request id may be)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion of a request: its tokens (prompt + output) and how many have K/V in the pool.

    With asynchronous scheduling a sampled token is appended as ``PENDING`` while it is still on the device
    (``num_pending`` of them, always the last ones); the engine fills it in a step later. ``finishing``: a
    pending token will end the sequence (``max_tokens`` or the context), so nothing more is scheduled for it.
    """

    seq_id: int
    request: Request
    index: int  # which of the request's n completions
    token_ids: list[int]
    output: CompletionOutput
    stopper: StopChecker | None  # None: the scheduler's own tests, which never sample
    seed: int | None  # the request's seed (SampleRow.seed; the completion's index keys its stream)
    num_computed: int = 0
    status: Status = Status.WAITING
    num_pending: int = 0
    finishing: bool = False
    # its place in its grammar (structured outputs), made when it samples
    constraint: Constraint | AfterReasoning | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens including the pending ones (what the scheduler computes)."""
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def detokenizer(self) -> IncrementalDetokenizer | None:
        """The output's text (None without a tokenizer)."""
        return None if self.stopper is None else self.stopper.detokenizer

    @property
    def computes_images(self) -> bool:
        """Whether its next chunk computes its prompt's images: the multimodal prefill, which computes the rest of
        the prompt in one chunk (never split: its images' tokens attend to each other)."""
        media = self.request.media
        return media is not None and media.images_from(self.num_computed)

    def add_pending(self) -> None:
        """Hold the slot of a token sampled on the device (:meth:`Scheduler.update` fills it in); when that token is
        its last for sure (``max_tokens`` or the context), the sequence is ``finishing``."""
        self.token_ids.append(PENDING)
        self.num_pending += 1
        if len(self.output.token_ids) + self.num_pending >= self.stopper.max_tokens:
            self.finishing = True


@dataclass(eq=False)
class Request:
    """A request of the engine: one prompt, ``params.n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n completions exist (made from the first one when its prompt is computed)
    error: str | None = None  # why the engine failed this request alone (its completions end with "error")
    lora: LoRAAdapter | None = None  # the LoRA adapter its tokens run through (None: the base model)
    media: MediaInputs | None = None  # its images' inputs: its prompt is computed by the multimodal prefill
    # each prompt token's logprob given those before it (None: not asked for; an entry None: not computed yet, and
    # always for the first token)
    prompt_logprobs: list | None = None
    serial: int = field(default_factory=lambda: next(_SERIALS))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(seq.status is Status.FINISHED for seq in self.seqs)


@dataclass
class ScheduledChunk:
    """Compute tokens ``[start, start + length)`` of ``seq`` in the next forward."""

    seq: Sequence
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token (its logits give the next token)."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    copies: list[BlockCopy]  # copy-on-write block copies to perform before the forward
    preempted: list[Sequence]
    out_of_blocks: list[Sequence]  # sequences the whole pool cannot hold (they end: the pool is the limit)


@dataclass
class StepOutput:
    """What a step computed, on the host: its chunks' K/V are in the pool, and ``targets[i]`` sampled
    ``tokens[i]`` (with ``logprobs[i]``)."""

    chunks: list[ScheduledChunk]
    targets: list[Sequence]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


class Scheduler:
    """FCFS iteration-level scheduler with chunked prefill, preemption by recompute and prefix caching."""

    def __init__(
        self,
        manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        loras: LoRAManager | None = None,
        media_offsets: Container[str] = (),
        hits_before_images: bool = True,
        hits_between_images: bool = True,
        whole_prompts: bool = False,
        release: Callable[[int], None] | None = None,
    ):
        """``media_offsets``: the content hashes of the images whose position offset the engine knows (prompts
        with them may take prefix-cache hits that cover their images). ``hits_before_images``: whether a prompt
        with images may take hits that end before its first image (its runner computes a prompt's images after a
        hit); ``hits_between_images``: and between two of its images (its runner computes some of a prompt's images
        alone). ``whole_prompts``: every prompt in one chunk (``ModelLayout.restarts_chunks``). ``release``: frees
        what else a finished sequence held, by its id (the engine's: its penalties' token counts, on the device)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1; got {max_num_seqs}, {max_num_batched_tokens}"
            )
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.loras = loras
        self.media_offsets = media_offsets
        self.hits_before_images = hits_before_images
        self.hits_between_images = hits_before_images and hits_between_images
        self.whole_prompts, self.release = whole_prompts, release
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ------------------------------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (its blocks are already shared with the parent)."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._acquire_lora(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def decoding_only(self) -> bool:
        """Whether the next step decodes one token of every running sequence and nothing else (no sequence waiting,
        none with a prompt still being computed), and no grammar needs a token on the host first."""
        return not self.waiting and all(
            seq.num_tokens - seq.num_computed <= 1
            and (seq.num_pending or seq.output.token_ids)
            and seq.request.params.structured_outputs is None  # its mask needs the last token on the host
            for seq in self.running
        )

    # -------------------------------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [], [])
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.finishing:  # preempted in this loop / nothing left to do
                continue
            rest = seq.num_tokens - seq.num_computed  # (images: admitted before a step that raised)
            length = rest if seq.computes_images or self.whole_prompts else min(rest, budget)
            if not self._grow(seq, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, length))
            budget = max(0, budget - length)
        room = budget  # what the running sequences leave: all a whole prompt could wait for while they run
        passed: list[Sequence] = []  # waiting for a LoRA slot: back at their places after this step's admissions
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if self._never_fits(seq) and not seq.num_pending:  # preempted at a length the pool cannot hold
                out.out_of_blocks.append(self.waiting.popleft())
                continue
            joining = seq.request.params.n if not seq.request.forked else 1  # its siblings fork in later
            if self._num_sequences() + joining > self.max_num_seqs:
                break
            # no slot for its adapter: it waits, and so do the adapter requests behind it (base-model ones go on), so
            # the adapters running drain and free a slot rather than keep it forever
            if seq.request.lora is not None and (passed or not self._lora_slot_ready(seq)):
                passed.append(self.waiting.popleft())
                continue
            hit = self._prefix_hit(seq)
            if self._waits_whole(seq, budget, room, hit) or not self._admit(seq, hit):
                break  # (FCFS: the requests behind it wait)
            self.waiting.popleft()
            rest = seq.num_tokens - seq.num_computed
            length = rest if seq.computes_images or self.whole_prompts else min(rest, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, length))
            budget = max(0, budget - length)
        self.waiting.extendleft(reversed(passed))
        return out

    def _num_sequences(self) -> int:
        """Running sequences, counting the siblings that requests still in prefill will fork."""
        return sum(seq.request.params.n if not seq.request.forked else 1 for seq in self.running)

    def _grow(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give a running sequence slots for all its tokens, preempting newer sequences if the pool is full."""
        if self._never_fits(seq):  # it would need the whole pool and more: preempting others cannot help
            out.out_of_blocks.append(seq)
            return False
        missing = seq.num_tokens - self.manager.seq_len(seq.seq_id)
        while self.manager.blocks_to_append(seq.seq_id, missing) > self.manager.num_free_blocks:
            victim = self.running[-1]
            if victim is seq:
                if len(self.running) == 1:
                    out.out_of_blocks.append(seq)
                else:
                    self._preempt(seq, out)
                return False
            self._preempt(victim, out)
        new = seq.token_ids[self.manager.seq_len(seq.seq_id) :]
        out.copies += self.manager.append(seq.seq_id, missing, new, computed=False)
        return True

    def _never_fits(self, seq: Sequence) -> bool:
        return self.manager.blocks_needed(seq.num_tokens) > self.manager.num_blocks

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """What admitting ``seq`` now would find in the prefix cache and take from the pool (nothing allocated)."""
        return self.manager.prefix_hit(seq.token_ids, **self._cache_keys(seq))

    def _cache_keys(self, seq: Sequence) -> dict:
        """What the prefix cache keys a sequence's blocks by besides its tokens (``add_sequence``'s arguments)."""
        return dict(zip(("salt", "salts_from"), _cache_salts(seq)), unsplit=self._unsplit(seq))

    def _waits_whole(self, seq: Sequence, budget: int, room: int, hit: PrefixHit) -> bool:
        """Whether a waiting prompt computed in one chunk from its prefix-cache hits on (one with images there, or any
        under ``whole_prompts``) waits for the next step: prompts admitted before it took the ``budget`` it needs of
        the ``room`` the running sequences leave. One longer than that room goes past the budget now."""
        media = seq.request.media
        whole = self.whole_prompts or (media is not None and media.images_from(hit.tokens))
        return whole and budget < seq.num_tokens - hit.tokens <= room

    def _admit(self, seq: Sequence, hit: PrefixHit) -> bool:
        """Allocate blocks for a waiting sequence's tokens (its prefix-cache ``hit`` reused); False if the pool is
        short of them, would be left with no room for the running sequences to grow, or has no state slot free."""
        watermark = max(1, self.manager.num_blocks // 100) if self.running else 0
        if hit.free_blocks + watermark > self.manager.num_free_blocks:
            return False
        try:
            keys = self._cache_keys(seq)
            cached = self.manager.add_sequence(seq.seq_id, seq.token_ids, computed=False, hit=hit, **keys)
        except CacheFullError:  # no state slot free (a model whose layers keep recurrent state)
            return False
        seq.num_computed = cached
        if seq.request.metrics.first_scheduled_time is None:
            seq.request.metrics.num_cached_tokens = cached
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._acquire_lora(seq)
        return True

    def recompute(self, seq: Sequence) -> None:
        """Take a running sequence's blocks (and recurrent state) back now: it goes to the front of the queue and is
        computed again from its tokens (a step that failed after a hybrid model's layers advanced its state)."""
        if seq.status is Status.RUNNING:
            self._preempt(seq, SchedulerOutput([], [], [], []))

    def _unsplit(self, seq: Sequence) -> tuple[tuple[int, int], ...]:
        """The token spans ``(start, end)`` a prefix-cache hit of ``seq`` must not end inside (``BlockManager``). An
        image is computed whole: hits end before one (before the first where not ``hits_between_images``, none where
        not ``hits_before_images``), or past the last once the position offset its images give is known."""
        media = seq.request.media
        if media is None:
            return ()
        units = media.units
        known = bool(units) and media.digest in self.media_offsets
        after = units[-1][1] if known else seq.num_tokens  # (a hit leaves one token at least)
        if not units or not self.hits_before_images:
            return ((0, after),)
        if not self.hits_between_images:
            return ((units[0][0], after),)
        return (*((start, end) for start, end, _ in units[:-1]), (units[-1][0], after))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's blocks; it goes back to the front of the queue and is recomputed."""
        self.running.remove(seq)
        self._release_lora(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.request.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.chunks = [chunk for chunk in out.chunks if chunk.seq is not seq]

    # ---------------------------------------------------------------------------------- updates, finishing
    def update(self, output: StepOutput) -> list[Request]:
        """Take a step's output: its computed blocks registered for prefix caching, then each sampled token filled
        in, appended to its sequence's output, checked for stops and detokenized, finished sequences freed.
        Returns the requests whose sequences took a token (one whose tokenizer or stop strings raise fails
        alone)."""
        for chunk in output.chunks:
            if chunk.seq.status is Status.RUNNING:  # not preempted, finished or aborted since
                self.manager.mark_computed(chunk.seq.seq_id, chunk.start + chunk.length)
        updated = []
        for seq, token, logprob in zip(output.targets, output.tokens, output.logprobs):
            if seq.status is Status.FINISHED:  # stopped, aborted or failed while this token was in flight
                continue
            updated.append(seq.request)
            try:
                self._fill_pending(seq, token)
                self._append_token(seq, token, logprob)
            except Exception as error:
                self.fail(seq.request, error)
                continue
            if seq.finishing and not seq.num_pending and seq.status is not Status.FINISHED:
                self.finish(seq, "length")
        return updated

    def _fill_pending(self, seq: Sequence, token: int) -> None:
        position = seq.num_known_tokens
        seq.token_ids[position] = token
        seq.num_pending -= 1
        if seq.status is Status.RUNNING and position < self.manager.seq_len(seq.seq_id):
            self.manager.set_token(seq.seq_id, position, token)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """The token in the sequence's output, then its stop rules (the stop checker, the grammar)."""
        out, now = seq.output, time.perf_counter()
        out.token_ids.append(token)
        if logprob is not None:
            out.logprobs.append(logprob)
        metrics = seq.request.metrics
        if seq.index == 0:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.token_times.append(now)
        ended = seq.stopper.check(token, len(out.token_ids))
        if seq.constraint is not None:
            if not seq.constraint.accept(token):
                raise RuntimeError(f"token {token} is not allowed by the request's structured_outputs grammar")
            if ended is None and seq.constraint.finished:
                ended = ("stop", token)  # the grammar ended on a stop token the request's EOS list lacks
        if ended is not None:
            self.finish(seq, *ended)

    def end_out_of_blocks(self, plan: SchedulerOutput) -> list[Request]:
        """End the plan's sequences the whole pool cannot hold ("length": the pool is the limit); one with a token in
        flight ends when it arrives. Returns the requests of those ended now."""
        ended = []
        for seq in plan.out_of_blocks:
            if seq.num_pending:
                seq.finishing = True
            else:
                self.finish(seq, "length")
                ended.append(seq.request)
        return ended

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a sequence now (``reason``: its output's finish reason): tokens still in flight are dropped when
        they arrive, it leaves the queues and its blocks are freed at once."""
        seq.output.finish_reason, seq.output.stop_reason = reason, stop_reason
        if seq.num_pending:  # tokens sampled past the end
            del seq.token_ids[-seq.num_pending :]
            seq.num_pending = 0
        if seq.detokenizer is not None and not isinstance(stop_reason, str) and reason != "error":
            seq.detokenizer.flush()  # a stop string already cut the text
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release_lora(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.manager:
            self.manager.free(seq.seq_id)
        seq.status = Status.FINISHED
        if self.release is not None:
            self.release(seq.seq_id)
        if seq.request.finished:
            seq.request.metrics.finished_time = time.perf_counter()

    def finish_request(self, request: Request, reason: str) -> None:
        """End every completion of ``request`` not finished yet (``reason``: "abort", "error")."""
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self.finish(seq, reason)

    def fail(self, request: Request, error: Exception) -> None:
        """End a request whose part of a step raised: its completions finish with "error", blocks freed."""
        request.error = f"the engine failed this request: {type(error).__name__}: {error}"
        self.finish_request(request, "error")

    # -------------------------------------------------------------------------------------- LoRA slots
    def _lora_slot_ready(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter (if any) is loaded or can be: a slot free or held by an idle adapter."""
        adapter = seq.request.lora
        return adapter is None or self.loras.can_acquire(adapter)

    def _acquire_lora(self, seq: Sequence) -> None:
        if seq.request.lora is not None:
            self.loras.acquire(seq.request.lora)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.request.lora is not None:
            self.loras.release(seq.request.lora)


def _cache_salts(seq: Sequence) -> tuple[Hashable, tuple[tuple[int, Hashable], ...]]:
    """What the sequence's K/V depend on besides its tokens, as ``BlockManager`` salts them: its LoRA adapter (None:
    the base model) from its first token, each image's content and length (``MediaInputs.units``) from its first
    token (all its images' from its first image token where they are not located one by one, from its first token
    where not located). A request that asks for prompt logprobs has a salt of its own: its prompt is computed, not
    taken from the prefix cache."""
    adapter = None if seq.request.lora is None else seq.request.lora.cache_key
    media = seq.request.media
    if seq.request.params.prompt_logprobs is not None:
        return (adapter, "prompt logprobs", seq.request.serial), ()
    if media is None:
        return adapter, ()
    units = media.units or ((0, 0, media.digest),)
    return adapter, tuple((start, ("images", digest, end - start)) for start, end, digest in units)
