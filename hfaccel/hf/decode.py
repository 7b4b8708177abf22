"""hfaccel's decode loop behind ``model.generate``: the runner's packed prefill and static decode steps (compiled
and CUDA-graph captured on CUDA), with transformers' own logits processors and stopping criteria.

``generate`` hands this loop (as ``custom_generate``) everything it prepared — the left-padded ``input_ids``, the
attention mask, the ``LogitsProcessorList`` and ``StoppingCriteriaList`` built from the call's options — so every
processor and criterion is transformers' own and the tokens are exactly those of its greedy / sampling loop
(``_sample``): the same processors on the same fp32 logits, ``argmax`` or ``multinomial`` on the same device and
generator, finished rows padded with ``pad_token_id``. What changes is how the model runs:

- the prompt is packed: each row's real tokens only (left padding takes no KV memory), one forward for all rows;
- every decode step is one static step of the runner's decode mode (``runner/graphs.py``): slots and lengths
  advance on the device, the host only hands over the new tokens;
- nothing waits for the device inside the loop on CUDA: whether every row has finished is read one step late
  (a non-blocking copy), and the step computed past the end is undone — its token dropped, the random generator
  put back — so the output and the generator's state are those of transformers' loop.

A request the loop cannot serve (a mask that is not left padding, ``inputs_embeds``, outputs beyond the token
ids, several processes) runs transformers' own ``_sample`` with the same arguments; ``model.hfaccel.decode``
says which loop served the last call and why.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from hfaccel import compat
from hfaccel.device import model_device
from hfaccel.distributed import tensor_parallel
from hfaccel.hf import multimodal
from hfaccel.kv import KVPool
from hfaccel.kv.fp8 import KVScales
from hfaccel.runner import ModelRunner, compiles
from hfaccel.runner.graphs import DEFAULT_LADDER, context_bucket
from hfaccel.runner.multimodal import prefill_batch
from hfaccel.runner.runner import packed_token_limit

_log = logging.getLogger("hfaccel")
POOL_GRANULE = 64  # the pool grows in multiples of this many blocks
PARKED_STEPS = 8  # decode steps kept for adapter states other than the current one (a PEFT model's)


@dataclass
class DecodeInfo:
    """Which loop served a model's last ``generate`` call (``model.hfaccel.decode``)."""

    path: str = "none yet"  # "hfaccel" or "transformers"
    reason: str | None = None  # why transformers' loop served it

    def __str__(self) -> str:
        return self.path if self.reason is None else f"{self.path} ({self.reason})"


class DecodeSession:
    """The runner (KV pool and decode steps) one model's ``generate`` calls share; it grows to the largest request
    seen (a bigger pool or batch rebuilds the decode steps, a bounded number of times: sizes are bucketed).
    ``compile``: ``"auto"`` (on CUDA), True or False; ``kv_cache_dtype``, ``kv_scales``: how its pools (the decode
    loop's, speculative decoding's, a fallback's ``PagedCache``) store K/V (``hfaccel.kv.fp8``)."""

    def __init__(
        self,
        model,
        *,
        compile: bool | str,
        block_size: int = 16,
        kv_cache_dtype: torch.dtype | None = None,
        kv_scales: KVScales = None,
    ):
        self.model = model
        self.compile = compile
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales = kv_scales  # None: each pool's model's checkpoint scales (KVPool.for_model)
        self.runner: ModelRunner | None = None
        self.info = DecodeInfo()
        self.lock = threading.Lock()  # one call at a time runs the loop; a concurrent one runs transformers'
        self.speculative = None  # SpeculativeRunners of assisted generate() calls (made on the first)
        self._logged: set[str] = set()  # the reasons of transformers' loop already logged for this model
        # why transformers' static cache + compiled forward (compile=True where its loop is faster) failed, if it did
        self.static_compile_failure: str | None = None
        # a model transformers sharded with tp_plan: every rank runs this loop in lockstep (the same calls, the same
        # forwards, its own pool of its local KV heads), and each step's tokens are the leader's
        self.tp = tensor_parallel(model)
        # a PEFT model's adapter state at the current call (``LoraState.call_state``; None without LoRA layers):
        # static steps bake in which adapters run, so each state has its own
        self.adapters: Hashable = None
        self._steps_adapters: Hashable = None  # the state ``runner.graphs`` serves
        self._parked: dict = {}  # adapter state -> (its decode steps, the pool they last served)
        self._speculative_adapters: Hashable = None  # the state ``speculative``'s runners serve

    def served_by_transformers(self, reason: str) -> None:
        """Record that transformers' loop serves the current call and why; each reason is logged once per model
        (a whole-loop fallback is meant to be seen, not a silent detour)."""
        self.info = DecodeInfo("transformers", reason)
        if reason not in self._logged:
            self._logged.add(reason)
            _log.warning(
                "hfaccel: generate() on %s runs transformers' decoding loop, not hfaccel's, because of %s "
                "(logged once per model and reason; model.hfaccel.decode says which loop served each call)",
                type(self.model).__name__,
                reason,
            )

    def served_by_transformers_by_choice(self, reason: str) -> None:
        """Record that transformers' loop serves the current call because it is the faster path here (not a
        fallback: logged once per model at INFO)."""
        self.info = DecodeInfo("transformers", reason)
        if reason not in self._logged:
            self._logged.add(reason)
            _log.info(
                "hfaccel: generate() on %s runs transformers' decoding loop: %s", type(self.model).__name__, reason
            )

    def steps(self) -> str:
        """How the decode steps run (compiled, captured sizes, fallback reasons), or "not built yet"."""
        graphs = self.runner.graphs if self.runner is not None else None
        return graphs.status() if graphs is not None else "not built yet"

    def release(self) -> None:
        """Give back the memory of the session's runners (its decode loop's and its speculative decoding's)."""
        self._parked.clear()
        if self.runner is not None:
            self.runner.release()
            self.runner = None
        if self.speculative is not None:
            self.speculative.release()

    def speculative_runners(self, make):
        """The runners assisted ``generate`` calls keep (``make()`` the first time), released and rebuilt when the
        adapter state changed since they were built."""
        if self.speculative is not None and self._speculative_adapters != self.adapters:
            self.speculative.release()
        self._speculative_adapters = self.adapters
        self.speculative = self.speculative or make()
        return self.speculative

    def runner_for(self, rows: int, capacities: list[int]) -> ModelRunner:
        """A runner whose pool holds ``rows`` sequences of ``capacities[i]`` tokens and whose decode steps serve
        them; the pool is empty when it is returned. The decode steps are made for every ladder batch size and,
        compiled or captured, the model's whole context (``max_position_embeddings``; ``context_bucket``), and
        a pool that grows is swapped in under them: one compiled step serves every call (only a batch past the
        ladder or a context past the model's rebuilds them)."""
        size = self.block_size
        needed = sum(-(-c // size) for c in capacities)
        runner = self.runner
        if runner is not None and (
            runner.pool.dtype != self.model.dtype or runner.pool.device != model_device(self.model)
        ):
            runner.release()  # the model moved or changed dtype: everything is rebuilt for it
            self.runner = runner = None
        if runner is None:
            runner = self.runner = ModelRunner(self.model, self._pool(needed, rows))
            self._parked.clear()
            self._steps_adapters = self.adapters
        self._steps_for_adapters(runner)
        states = runner.pool.states
        if runner.pool.num_blocks < needed or states is not None and states.num_slots < rows:
            blocks, seqs = max(needed, 2 * runner.pool.num_blocks), max(rows, states.num_slots if states else 0)
            runner.replace_pool(lambda: self._pool(blocks, seqs))
        graphs = runner.graphs
        context = max(capacities)
        if graphs is None or graphs.max_batch < rows or graphs.max_model_len < context:
            compile = compiles(self.compile, runner.device)
            max_batch = max(
                rows,
                min(DEFAULT_LADDER[-1], runner.max_tokens or DEFAULT_LADDER[-1]),
                graphs.max_batch if graphs else 0,
            )
            max_len = max(
                context_bucket(context, whole=compile or runner.device.type == "cuda", model=self.model),
                graphs.max_model_len if graphs else 0,
            )
            if compile:
                _log.warning(
                    "hfaccel: generate() compiles its decode step on the first call (once per model: every "
                    "batch size up to %d and context up to %d tokens; this takes a while)",
                    max_batch,
                    max_len,
                )
            runner.enable_decode_graphs(max_batch, max_len, compile=compile)
        return runner

    def _steps_for_adapters(self, runner: ModelRunner) -> None:
        """Give ``runner`` the decode steps of the current adapter state: those of the state before are parked (up to
        ``PARKED_STEPS`` states, the oldest dropped) and come back when it does — compiled and captured, told of a
        pool replaced meanwhile; a state not seen yet gets steps built by :meth:`runner_for`."""
        if self.adapters == self._steps_adapters:
            return
        if runner.graphs is not None:
            self._parked[self._steps_adapters] = (runner.graphs, runner.pool)
            while len(self._parked) > PARKED_STEPS:
                del self._parked[next(iter(self._parked))]
        graphs, pool = self._parked.pop(self.adapters, (None, None))
        if graphs is not None and pool is not runner.pool:
            graphs.pool_changed()
        runner.graphs = graphs
        self._steps_adapters = self.adapters

    def _pool(self, blocks: int, rows: int) -> KVPool:
        """A pool of at least ``blocks`` blocks, and state slots for ``rows`` sequences where the model keeps
        recurrent state (the ladder size that holds them: a few sizes are ever made)."""
        blocks = -(-blocks // POOL_GRANULE) * POOL_GRANULE
        seqs = next((size for size in DEFAULT_LADDER if size >= rows), rows)
        return KVPool.for_model(
            self.model, num_blocks=blocks, block_size=self.block_size, max_num_seqs=seqs, **self.pool_options()
        )

    def pool_options(self) -> dict:
        """How this session's pools store K/V: ``KVPool``'s ``kv_cache_dtype`` and ``kv_scales``."""
        return {"kv_cache_dtype": self.kv_cache_dtype, "kv_scales": self.kv_scales}


def hfaccel_sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
):
    """``generate``'s decoding method for an accelerated model (module docstring): the ids ``[B, L + new]``."""
    session: DecodeSession = model.hfaccel.session
    if streamer is not None:
        streamer.put(input_ids.cpu())  # generate() puts the prompt itself only when it holds the streamer
    mask = model_kwargs.get("attention_mask")
    images = multimodal.multimodal_inputs(model, model_kwargs)
    reason = _unsupported(input_ids, generation_config, synced_gpus, model_kwargs, images)
    images = images if multimodal.carries_images(images) else []  # token types alone: a text prompt
    pads = [0] * input_ids.shape[0]
    if reason is None and mask is not None:
        pads = left_padding(mask)  # one read of the mask per call
        if pads is None:
            reason = "an attention mask that is not left padding"
    if reason is None:
        reason = _beyond_limit(model, pads, input_ids.shape[1], int(generation_config.max_length))
    if reason is None and not session.lock.acquire(blocking=False):
        reason = "another generate() call on this model is running hfaccel's decode loop"
    if reason is not None:
        session.served_by_transformers(reason)
        return compat.transformers_sample(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus=synced_gpus,
            streamer=streamer,
            **model_kwargs,
        )
    try:
        session.info = DecodeInfo("hfaccel")
        lengths = [input_ids.shape[1] - pad for pad in pads]
        packed = input_ids[mask.bool()] if mask is not None else input_ids.reshape(-1)  # [T]: real tokens only
        loop = _Loop(session, input_ids, logits_processor, stopping_criteria, generation_config, streamer)
        if images:
            return loop.run(
                lengths,
                functools.partial(
                    prefill_batch,
                    model,
                    input_ids=input_ids,
                    generation_config=generation_config,
                    model_kwargs=model_kwargs,
                ),
            )
        return loop.run(lengths, packed)
    finally:
        session.lock.release()


def left_padding(mask: torch.Tensor) -> list[int] | None:
    """Each row's left padding of a 2-D attention mask ``[B, L]``, or None when some row is not left padding
    (zeros then ones) — reads the mask on the host."""
    host = mask.bool().cpu()
    if not bool((host[:, 1:] >= host[:, :-1]).all()):
        return None
    return (~host).sum(1).tolist()


def _unsupported(
    input_ids: torch.Tensor, config, synced_gpus: bool, model_kwargs: dict, images: list[str]
) -> str | None:
    """Why this call needs transformers' loop (before looking at the mask's values), or None. ``images``: the
    multimodal inputs the loop's multimodal prefill takes."""
    if synced_gpus:
        return "synced_gpus"
    if config.return_dict_in_generate:
        return "return_dict_in_generate"
    extra = sorted(
        k
        for k, v in model_kwargs.items()
        if k not in multimodal.TEXT_INPUTS and k not in images and multimodal.given(v)
    )
    if extra:
        return f"model inputs {extra}"
    if model_kwargs.get("output_attentions") or model_kwargs.get("output_hidden_states"):
        return "attention or hidden-state outputs"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or mask.shape != input_ids.shape):
        return f"an attention mask of shape {tuple(mask.shape)} for input_ids {tuple(input_ids.shape)}"
    return None


def _beyond_limit(model, pads: list[int], width: int, max_length: int) -> str | None:
    """Why rows of ``width`` tokens left-padded by ``pads``, growing to ``max_length``, are past what hfaccel's
    packed forwards are exact for on this model (``hfaccel.runner.runner.packed_token_limit``), or None: a prefill
    of more tokens than the limit, or left-padded rows past it (transformers scales their attention temperature at
    the padded position, hfaccel at the row's own)."""
    limit = packed_token_limit(model.config)
    if limit is None:
        return None
    if (prompts := sum(width - pad for pad in pads)) > limit:
        return f"prompts of {prompts} tokens: past the {limit} tokens one of hfaccel's packed forwards is exact for"
    if any(pads) and max_length > limit:
        return (
            f"left-padded rows growing to {max_length} tokens: past the {limit} tokens up to which transformers' "
            "attention temperature at a padded position is the row's own"
        )
    return None


class _Loop:
    """One ``generate`` call's decode loop (module docstring)."""

    def __init__(self, session: DecodeSession, input_ids: torch.Tensor, processors, criteria, config, streamer):
        self.session, self.processors, self.criteria, self.streamer = session, processors, criteria, streamer
        self.tp = session.tp
        self.do_sample = bool(config.do_sample)
        self.pad = compat.generation_pad_tensor(config)
        self.pad_finished = any(hasattr(criterion, "eos_token_id") for criterion in criteria)
        batch, self.prompt_len = input_ids.shape
        self.max_length = int(config.max_length)
        self.ids = input_ids.new_empty(batch, self.max_length)  # [B, max_length]
        self.ids[:, : self.prompt_len] = input_ids
        self.unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
        self.deferred = defers_stop_checks(input_ids.device)

    def run(self, lengths: list[int], prompt: torch.Tensor | Callable) -> torch.Tensor:
        """Prefill the rows' real tokens (``lengths[i]`` of them for row ``i``: ``prompt [T]`` packed, or
        ``prompt(runner, seq_ids, lengths)`` the multimodal prefill into the runner's sequences), then decode."""
        batch, new_tokens = len(lengths), self.max_length - self.prompt_len
        capacities = [n + new_tokens for n in lengths]
        runner = self.session.runner_for(batch, capacities)
        seq_ids = list(range(batch))
        runner.pool.reserve(seq_ids, capacities)
        try:
            if callable(prompt):
                logits = prompt(runner, seq_ids, lengths)  # [B, V]
            else:
                logits = runner.forward(seq_ids, prompt, lengths, starts=[0] * batch)  # [B, V]
            runner.graphs.begin(seq_ids, lengths)
            return self._decode(runner, logits)
        finally:
            for seq_id in seq_ids:
                runner.free(seq_id)

    def _decode(self, runner: ModelRunner, logits: torch.Tensor) -> torch.Tensor:
        cur, previous = self.prompt_len, None
        flags = (_StepFlag(self.ids.device), _StepFlag(self.ids.device))  # alternate: one is read, one written
        while True:
            rng = _rng_state(self.ids.device) if self.deferred and self.do_sample else None
            tokens = self._select(logits, cur)  # [B]
            self.ids[:, cur] = tokens
            cur += 1
            self.unfinished &= ~self.criteria(self.ids[:, :cur], None)
            if not self.deferred:
                self._stream(tokens)
                if cur >= self.max_length or int(self.unfinished.max()) == 0:
                    break
            else:
                if previous is not None:  # the step before's verdict, arrived while this one was queued
                    finished_before = previous.done()
                    self._stream(previous.tokens)
                    if finished_before:  # transformers' loop ended there: undo this step
                        cur -= 1
                        if rng is not None:
                            _set_rng_state(self.ids.device, rng)
                        break
                if cur >= self.max_length:
                    self._stream(tokens)
                    break
                previous = flags[cur % 2].record(self.unfinished, tokens if self.streamer is not None else None)
            logits = runner.graphs.advance(tokens)
        if self.streamer is not None:
            self.streamer.end()
        return self.ids[:, :cur]

    def _select(self, logits: torch.Tensor, cur: int) -> torch.Tensor:
        """The next token of every row, as transformers' ``_sample`` picks it."""
        scores = self.processors(self.ids[:, :cur], logits.to(torch.float32))
        if self.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if self.tp is not None:  # every rank drew (its generator advances as transformers' would): the leader's count
            self.tp.broadcast(tokens)
        if self.pad_finished:
            tokens = tokens * self.unfinished + self.pad * (1 - self.unfinished)
        return tokens

    def _stream(self, tokens: torch.Tensor | None) -> None:
        if self.streamer is not None and tokens is not None:
            self.streamer.put(tokens.cpu())


def defers_stop_checks(device: torch.device) -> bool:
    """Whether the loop reads "every row finished" a step late (on CUDA, where reading it at once would make the
    host wait for the device every step)."""
    return device.type == "cuda"


class _StepFlag:
    """Whether every row had finished after a step (and its tokens, for a streamer), copied to the host without
    waiting, read a step later. Made once per call and recorded again each other step."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.flag = torch.empty((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.tokens: torch.Tensor | None = None

    def record(self, unfinished: torch.Tensor, tokens: torch.Tensor | None) -> _StepFlag:
        self.flag.copy_(unfinished.max() == 0, non_blocking=True)
        self.tokens = tokens.to("cpu", non_blocking=True) if tokens is not None else None
        if self.event is not None:
            self.event.record()
        return self

    def done(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
