"""``hfaccel.Engine``: continuous batching over one Hugging Face model.

Requests come in at any time (``add_request``: prompts tokenized and checked by ``inputs``); each ``step`` is
schedule → run → update: the ``scheduler`` picks every running sequence's next token plus prefill chunks of waiting
ones, the ``executor`` runs them in one packed forward and samples the sequences whose prompt or last token was just
computed, and ``Scheduler.update`` takes the sampled tokens and finishes the sequences that hit EOS, a stop token or
string, ``max_tokens`` or the context length, freeing their blocks at once. ``generate`` and ``stream`` drive steps
for the caller (``blocking``; ``deltas``: what is new after each); ``AsyncEngine`` drives them from a background
thread for services.

Asynchronous scheduling (the default on CUDA): in the decode steady state a step queues its forward and sampling
on the device and then handles the previous step's tokens — stop checks, detokenization, freeing — while the
device computes. The next step is scheduled before those tokens reach the host: each sequence that sampled one
holds a ``PENDING`` slot for it, and the forward reads the token from the previous step's device tensor. A
sequence that turns out to have stopped drops the one token computed past its end. While requests wait or
prompts are being computed, steps do not overlap (``Engine._overlaps``): admissions then see the blocks and
slots just freed, and first tokens reach the host a step sooner. Outputs are the same either way.

LoRA adapters (``lora_adapters``): requests name their adapter (``lora=``) and requests of different adapters and of
the base model share each batch; the model's Linear layers are wrapped with a pool of ``max_loras`` adapter slots
(``hfaccel.lora``) while the engine serves — :meth:`Engine.close` gives them back.

One bad request never fails another: parameters are checked against the model before a request joins a batch
(``check_params``), and a request whose part of a step raises anyway is failed alone (``StepExecutor``).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from hfaccel import compat
from hfaccel.attention import set_hfaccel_attention, uses_hfaccel_attention
from hfaccel.device import model_device, raise_if_lost
from hfaccel.distributed import (
    StepChannel,
    TensorParallel,
    TPRole,
    agree_on_static_steps,
    agreed_budget,
    check_sharding,
    shards_beyond_language_model,
    tensor_parallel,
    tp_runner,
)
from hfaccel.engine.blocking import BlockingCalls
from hfaccel.engine.deltas import snapshot
from hfaccel.engine.executor import HostTimes, StepExecutor
from hfaccel.engine.inputs import Intake, PreparedPrompt, Prompt
from hfaccel.engine.kv_budget import plan_kv_cache
from hfaccel.engine.lora_admin import LoRAAdmin
from hfaccel.engine.media import MediaInputs, is_processor
from hfaccel.engine.outputs import RequestOutput
from hfaccel.engine.scheduler import Request, Scheduler
from hfaccel.kv import KVPool
from hfaccel.kv.fp8 import KVScales, resolve_kv_cache_dtype
from hfaccel.lora import LoRAAdapter
from hfaccel.runner import ModelRunner, compiles
from hfaccel.runner.multimodal import EncoderCache, MediaOffsets
from hfaccel.runner.runner import packed_token_limit
from hfaccel.runner.support import check_served
from hfaccel.sampling import SamplingParams, TokenCounts, eos_token_ids

_log = logging.getLogger("hfaccel")


class Engine(TPRole, LoRAAdmin, BlockingCalls):
    """Continuous-batching generation engine over a Hugging Face causal LM (docs/usage.md, docs/serving.md).

    Args:
        model: the model (put on hfaccel's attention here; ``ValueError`` if it cannot be). Under tensor parallelism
            every rank makes the engine alike: rank 0 (``is_leader``) serves, the others :meth:`follow`.
        tokenizer: its tokenizer, or an image-text-to-text model's processor (prompts with images then).
        max_num_seqs: sequences decoded together at most.
        max_num_batched_tokens: tokens per forward at most (decode tokens + prefill chunks).
        num_blocks: KV pool size in blocks (default: ``hfaccel.engine.kv_budget``, what ``stats()`` reports).
        kv_cache_memory: KV pool size in bytes instead (not with ``num_blocks``).
        block_size: token slots per block.
        enable_prefix_caching: requests sharing a prompt prefix share its KV blocks.
        max_model_len: longest sequence, prompt + output (default: the model's context).
        kv_cache_fraction: on CUDA, the most of the device's total memory the default pool takes.
        cuda_graphs: decode steps replay CUDA graphs per padded batch size (default: on CUDA).
        compile: decode steps compiled by ``torch.compile``: True, False or ``"auto"`` (on CUDA).
        async_scheduling: launch each decode step before the last one's tokens reach the host (default: on CUDA);
            ``step()`` then returns what the step before it produced.
        lora_adapters: ``{name: PEFT LoRA adapter directory}`` served (None: the base model only, unchanged).
        max_loras: adapters one step serves at most (device slots).
        max_lora_rank: the slots' rank; an adapter of a higher rank is refused.
        lora_target_modules: Linear layers wrapped for adapters added later (default: attention and MLP).
        kv_cache_dtype: the pool's storage: ``"auto"`` / None (the model's dtype) or ``"fp8"`` (e4m3).
        kv_scales: an fp8 pool's scales: None (the checkpoint's, else 1.0), a number, or ``"prefill"``.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        kv_cache_fraction: float = 0.5,
        cuda_graphs: bool | None = None,
        compile: bool | str = "auto",
        async_scheduling: bool | None = None,
        lora_adapters: Mapping[str, str | os.PathLike] | None = None,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        lora_target_modules: Sequence[str] | None = None,
        kv_cache_dtype: str | torch.dtype | None = None,
        kv_scales: KVScales = None,
    ):
        kv_cache_dtype = _check_arguments(model, compile, kv_cache_dtype, kv_scales, lora_adapters)
        self.tp = tensor_parallel(model)
        _use_hfaccel_attention(model)
        self._closed = False
        # LoRA layers first: their slots take memory the KV budget must see (and nothing changes if one is bad)
        self._serve_loras(model, lora_adapters, max_loras, max_lora_rank, lora_target_modules)
        try:
            self.model = model
            self.processor = tokenizer if is_processor(tokenizer) else None  # takes prompts with images
            self.tokenizer = tokenizer.tokenizer if self.processor is not None else tokenizer
            self.vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
            self.max_model_len, max_num_batched_tokens, max_num_seqs = _limits(
                model.config, max_model_len, max_num_batched_tokens, max_num_seqs
            )
            self.kv_budget = plan_kv_cache(
                model,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                num_blocks=num_blocks,
                kv_cache_memory=kv_cache_memory,
                kv_cache_fraction=kv_cache_fraction,
                kv_cache_dtype=kv_cache_dtype,
            )
            if self.tp is not None:
                self.kv_budget = agreed_budget(self.tp, self.kv_budget)
            block_size = self.kv_budget.block_size  # (a recurrent-only model's: max_model_len)
            pool_options = dict(
                num_blocks=self.kv_budget.num_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
                kv_scales=kv_scales,
            )
            # no sequence outgrows the pool: the steps' per-sequence tables need no more (a context of millions)
            held = min(self.max_model_len, self.kv_budget.num_blocks * block_size)
            self.runner, self._channel = _make_runner(
                model, self.tp, self.loras, max_num_batched_tokens, held, pool_options
            )
            _log.info("hfaccel Engine: %s", self.kv_budget)
            on_cuda = self.runner.device.type == "cuda"
            _build_static_steps(
                self.runner,
                self.tp,
                cuda_graphs if cuda_graphs is not None else on_cuda,
                compile,
                max_num_seqs,
                held,
            )
            self.async_scheduling = on_cuda if async_scheduling is None else async_scheduling
            token_counts = TokenCounts(self.vocab_size, self.runner.device)  # the penalized sequences' counts
            self.media_offsets = MediaOffsets()  # where the text after recent prompts' images continues
            # the vision encoder's outputs of recent requests' images (encoded on the leader alone, unless sharded)
            self.encoder_cache = EncoderCache(ahead=self.tp is None or not shards_beyond_language_model(model))
            self.scheduler = Scheduler(
                self.runner.pool.manager,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                loras=self.loras,
                media_offsets=self.media_offsets,
                hits_before_images=compat.continues_multimodal_prompts(model),
                hits_between_images=self.encoder_cache.ahead,  # (a chunk takes its own images' encoded rows)
                whole_prompts=bool(self.runner.pool.layout.restarts_chunks),
                release=token_counts.release,
            )
            self.eos_token_ids = eos_token_ids(model.generation_config, self.tokenizer)
            self.intake = Intake(
                model,
                self.processor,
                self.tokenizer,
                self.runner.pool,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
                eos_token_ids=self.eos_token_ids,
                loras=self.loras,
            )
            self.requests: dict[str, Request] = {}
            self._ids = itertools.count()
            self.host_times = HostTimes(self.runner)
            self.executor = StepExecutor(
                model,
                self.runner,
                self.scheduler,
                new_sequence=self.intake.new_sequence,
                grammars=self.intake.grammars,
                token_counts=token_counts,
                loras=self.loras,
                media_offsets=self.media_offsets,
                encoder_cache=self.encoder_cache,
                host_times=self.host_times,
                async_scheduling=self.async_scheduling,
            )
        except BaseException:  # a start that fails leaves the model's layers as they were
            if self.loras is not None:
                self.loras.undo()
            raise

    # ------------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> str:
        """Queue a request; returns its id. A bad prompt or parameter raises ValueError and changes nothing. A
        :class:`PreparedPrompt` (from :meth:`prepare_prompt`) was checked already and carries its parameters and
        its LoRA adapter. ``lora``: the name of the LoRA adapter to run the request through (None: the base model;
        a name this engine does not serve: ValueError)."""
        self._need_leader("add_request")
        if self._closed:
            raise RuntimeError("this hfaccel Engine was closed (Engine.close()); make a new one")
        if isinstance(prompt, PreparedPrompt):
            prompt.check_call(params, lora)
            prepared = prompt
        else:
            prepared = self.prepare_prompt(prompt, params or SamplingParams(), lora=lora)
        self._check_registered(prepared.lora)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.requests[request_id] = self.intake.request(request_id, prepared, arrival_time)
        self.scheduler.add(request.seqs[0])
        return request_id

    def prepare_prompt(self, prompt: Prompt, params: SamplingParams, *, lora: str | None = None) -> PreparedPrompt:
        """The request checked and tokenized once (what :meth:`add_request` queues without checking again), or a
        ValueError saying why it cannot be served (``lora``: the name of its LoRA adapter, None for the base)."""
        return self.intake.prepare_prompt(prompt, params, self.lora_adapter(lora))

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt this engine can hold, or a ValueError saying why not. Thread-safe
        (a server runs it off its event loop)."""
        return self.intake.tokenize_prompt(prompt)

    def prepared(
        self,
        text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        params_checked: bool = False,
        lora: str | LoRAAdapter | None = None,
        media: MediaInputs | None = None,
    ) -> PreparedPrompt:
        """A :class:`PreparedPrompt` of ids :meth:`tokenize_prompt` (or :meth:`process_prompt`, with its ``media``)
        gave, ``params`` checked (unless they were), run through the LoRA adapter ``lora`` (a name, or the adapter
        :meth:`lora_adapter` gave; None: the base)."""
        adapter = lora if isinstance(lora, LoRAAdapter) else self.lora_adapter(lora)
        return self.intake.prepared(text, prompt_ids, params, adapter, media, params_checked=params_checked)

    def check_params(self, params: SamplingParams) -> None:
        """Raise :class:`~hfaccel.sampling.InvalidSamplingParams` (a ValueError) if this engine cannot serve
        ``params``: every value within what this model's vocabulary and the engine's limits hold. A request is
        checked here before it can join a batch, so a bad value never fails a step."""
        self.intake.check_params(params)

    def process_prompt(self, prompt: Prompt, **template) -> tuple[str | None, list[int], MediaInputs | None]:
        """(prompt text, token ids, multimodal inputs or None) of a prompt with images (or chat messages), by the
        engine's processor (``template``: chat-template arguments), or a ValueError saying why it cannot be served.
        Thread-safe (a server runs it off its event loop)."""
        return self.intake.process_prompt(prompt, **template)

    def check_media(self, media: MediaInputs | None, adapter: LoRAAdapter | None) -> None:
        """ValueError for what a request with images cannot have yet (a no-op without images)."""
        self.intake.check_media(media, adapter)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        request = self.requests.get(str(request_id))
        if request is None or request.finished:
            return False
        self.scheduler.finish_request(request, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def close(self) -> None:
        """Give the model back as it came: every request aborted, the LoRA layers unwrapped, the KV pool and decode
        steps released (the engine serves nothing afterwards; idempotent)."""
        if self._closed:
            return
        for request_id in list(self.requests):
            self.abort(request_id)
        self.executor.in_flight.clear()
        if self.loras is not None:
            self.loras.close()
        self.shutdown()
        self.runner.release()
        self._closed = True

    def release(self, request_id: str) -> None:
        """Forget a finished request (``generate`` and ``stream`` do this for their own requests)."""
        request = self.requests.get(str(request_id))
        if request is not None and request.finished:
            del self.requests[str(request_id)]

    # ---------------------------------------------------------------------------------------------- steps
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward; returns the requests whose outputs changed (full state)."""
        return [self.snapshot(request) for request in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """Run one step — schedule, run, update — and return the live requests it changed, copying nothing
        (``DeltaTracker`` reads the new part of each: what ``generate``, ``stream`` and ``AsyncEngine`` use, so a
        step costs the same however long the outputs already are). A step that raises an error the device keeps
        raises :class:`~hfaccel.device.DeviceLostError`: nothing more can run in this process."""
        self._need_leader("step")
        try:
            return self._step()
        except Exception as error:
            raise_if_lost(error, self.runner.device)
            raise

    def _step(self) -> list[Request]:
        touched: dict[str, Request] = {}
        overlap = self._overlaps()
        self._collect_all_but(1 if overlap else 0, touched)  # a step with prefill work sees the last one's tokens
        with self.host_times.timed("scheduling"):
            plan = self.scheduler.schedule()
            _touch(touched, self.scheduler.end_out_of_blocks(plan))
        with self.host_times.timed("launch"):
            launched, failed = self.executor.run(plan)
            _touch(touched, failed)
        # asynchronous: the previous step is collected while the device computes the one just launched
        self._collect_all_but(1 if overlap and launched is not None else 0, touched)
        if not self.has_unfinished_requests():
            self._collect_all_but(0, touched)  # its sequences have all finished: nothing to wait for
        return list(touched.values())

    def _overlaps(self) -> bool:
        """Whether this step is launched before the previous one is collected: with asynchronous scheduling, in
        the decode steady state only. A step with prefill work collects first, so its admissions see the blocks and
        slots just freed and a first token reaches the host a step sooner (overlapping mixed prefill + decode steps
        lost both throughput and TTFT; overlapping pure decode steps won)."""
        return self.async_scheduling and self.scheduler.decoding_only()

    def _collect_all_but(self, keep: int, touched: dict[str, Request]) -> None:
        """Collect the oldest launched steps until ``keep`` remain, the scheduler taking each one's tokens. A step
        leaves the queue only once collected, so a wait that raised (an interrupt, an error surfacing from the
        device) is retried."""
        in_flight = self.executor.in_flight
        while len(in_flight) > keep:
            output = self.executor.collect(in_flight[0])
            if output is not None:
                with self.host_times.timed("detokenizing"):
                    _touch(touched, self.scheduler.update(output))
            in_flight.popleft()

    # ------------------------------------------------------------------------------------------- state
    def snapshot(self, request: Request) -> RequestOutput:
        """The request's outputs so far (text held back where a stop string might still begin)."""
        return snapshot(request)

    def stats(self) -> dict[str, int | str]:
        """Requests and KV blocks now, the KV memory reserved, and how decode steps run (``decode_steps``:
        compiled or not, the sizes captured as CUDA graphs, and the reason of any fallback)."""
        graphs = self.runner.graphs
        stats = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **self.scheduler.manager.stats(),
            **self.kv_budget.stats(),
            "kv_cache_dtype": str(self.runner.pool.cache_dtype),
            "decode_steps": graphs.status() if graphs is not None else "eager (no static decode steps)",
        }
        if self.processor is not None:  # prompts with images: the encoder's outputs kept for their images
            stats["encoder_cache"] = str(self.encoder_cache)
        if self.loras is not None:  # adapters served, and how many of the max_loras slots hold one
            stats.update(lora_adapters=len(self.loras.adapters), lora_slots_loaded=self.loras.num_loaded)
        return stats


def _touch(touched: dict[str, Request], requests: Iterable[Request]) -> None:
    """Add ``requests`` to a step's changed requests (kept in the order they first changed)."""
    touched.update((request.request_id, request) for request in requests)


def _check_arguments(
    model, compile: bool | str, kv_cache_dtype, kv_scales: KVScales, lora_adapters: Mapping | None
) -> torch.dtype | None:
    """Refuse what the engine cannot serve before anything changes; returns the pool's KV dtype (None: the model's)."""
    compiles(compile, model_device(model))
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_device(model))
    if kv_scales is not None and kv_cache_dtype is None:
        raise ValueError(f"kv_scales={kv_scales!r} needs an fp8 pool (kv_cache_dtype='fp8')")
    check_sharding(model, "hfaccel.Engine")
    if tensor_parallel(model) is not None and lora_adapters is not None:
        raise ValueError(
            "hfaccel.Engine: LoRA adapters (lora_adapters) are not supported under tensor "
            "parallelism yet; serve them on one GPU, or merge the adapter into the model"
        )
    return kv_cache_dtype


def _make_runner(
    model, tp: TensorParallel | None, loras, max_num_batched_tokens: int, max_model_len: int, pool_options: dict
) -> tuple[ModelRunner, StepChannel | None]:
    """The engine's runner over a pool of ``pool_options``, and the TP step broadcast (None: one process)."""
    if tp is not None:
        return tp_runner(
            model, tp, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, **pool_options
        )
    runner = ModelRunner(model, KVPool.for_model(model, **pool_options))
    runner.lora = None if loras is None else loras.context
    return runner, None


def _use_hfaccel_attention(model) -> None:
    """Put the model on hfaccel's attention (the runner's packed forwards need it), or say why it cannot be."""
    check_served(model, "hfaccel.Engine")
    if not uses_hfaccel_attention(model):
        set_hfaccel_attention(model)


def _limits(config, max_model_len: int | None, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, int, int]:
    """``(max_model_len, max_num_batched_tokens, max_num_seqs)`` within the model's context, and within the tokens
    its packed forward is exact for where it has a limit (``packed_token_limit``: Llama 4)."""
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) or 1 << 20
    packed = packed_token_limit(config)
    if packed is not None:  # every forward and decode batch within what the runner is exact for
        max_num_batched_tokens, max_num_seqs = min(max_num_batched_tokens, packed), min(max_num_seqs, packed)
    return min(max_model_len or limit, limit), max_num_batched_tokens, max_num_seqs


def _build_static_steps(
    runner: ModelRunner,
    tp: TensorParallel | None,
    enabled: bool,
    compile: bool | str,
    max_num_seqs: int,
    max_model_len: int,
) -> None:
    """The runner's static decode steps when ``enabled`` — under tensor parallelism on every rank, in the same
    order, agreed on — each batch size compiled and captured now, with a progress line, so that no request (and no
    server's first request) waits for them."""
    if enabled:
        runner.enable_decode_graphs(
            max_num_seqs, max_model_len, draws=tp is None, compile=compiles(compile, runner.device)
        )
    graphs = runner.graphs
    if tp is not None:
        agree_on_static_steps(tp, graphs)
    if graphs is None or not (graphs.compiled or graphs.capture):
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("hfaccel Engine: compiling and capturing the decode steps", total=len(graphs.sizes))
        graphs.warm_up(progress=lambda done, total: progress.update(task, completed=done))
    _log.info("hfaccel Engine: decode steps ready (%s)", graphs.status())
