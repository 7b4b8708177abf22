"""``hfaccel.Engine``: continuous batching over one Hugging Face model.

Requests come in at any time (``add_request``), each ``step`` runs one packed forward of every running
sequence's next token plus prefill chunks of waiting ones (see ``scheduler``), samples the sequences whose
prompt or last token was just computed (``sampler``), and finishes those that hit EOS, a stop token or string,
``max_tokens`` or the context length, freeing their blocks at once. ``generate`` and ``stream`` drive steps
for the caller; ``AsyncEngine`` drives them from a background thread for services.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import torch

from hfaccel.engine.cuda_graphs import DecodeGraphs
from hfaccel.engine.detokenizer import IncrementalDetokenizer
from hfaccel.engine.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprob
from hfaccel.engine.runner import ModelRunner
from hfaccel.engine.sampler import SampleRow, sample
from hfaccel.engine.scheduler import Request, ScheduledChunk, Scheduler, Sequence as Seq, Status

Prompt = str | Sequence[int] | Sequence[dict]
CPU_POOL_BYTES = 1 << 30  # the default KV pool on the CPU: at most 1 GiB


class Engine:
    """Continuous-batching generation engine over a Hugging Face causal LM.

    Args:
        model: the model (accelerated here with ``hfaccel.accelerate`` if it is not yet).
        tokenizer: its tokenizer (needed for text prompts, chat messages, stop strings and output text).
        max_num_seqs: sequences decoded together at most.
        max_num_batched_tokens: tokens per forward at most (decode tokens + prefill chunks).
        num_blocks: KV pool size in blocks (default: ``kv_cache_fraction`` of free GPU memory, or on the CPU
            room for ``max_num_seqs`` sequences of up to 2048 tokens within 1 GiB).
        block_size: token slots per block.
        enable_prefix_caching: requests sharing a prompt prefix share its KV blocks.
        max_model_len: longest sequence (prompt + output); default the model's ``max_position_embeddings``.
        kv_cache_fraction: on CUDA, the share of free memory the default pool takes.
        cuda_graphs: decode-only steps replay CUDA graphs captured per padded batch size (default: on CUDA).
            ``True`` on another device runs the same static-shape decode step without capture.
    """

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096,
                 num_blocks: int | None = None, block_size: int = 16, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, kv_cache_fraction: float = 0.8, cuda_graphs: bool | None = None):
        _ensure_accelerated(model)
        self.model, self.tokenizer = model, tokenizer
        text_config = model.config.get_text_config(decoder=True)
        limit = getattr(text_config, "max_position_embeddings", None) or 1 << 20
        self.max_model_len = min(max_model_len or limit, limit)
        self.vocab_size = int(text_config.vocab_size)
        num_blocks = num_blocks or _default_num_blocks(model, block_size, max_num_seqs, self.max_model_len,
                                                       kv_cache_fraction)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size,
                                  enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.runner.cache.manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        if cuda_graphs is None:
            cuda_graphs = self.runner.device.type == "cuda"
        self.graphs = DecodeGraphs(self.runner, max_num_seqs, self.max_model_len) if cuda_graphs else None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    *, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. A bad prompt or parameter raises ValueError and changes nothing."""
        params = params or SamplingParams()
        text, prompt_ids = self.prepare_prompt(prompt, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, text, prompt_ids, params,
                          RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter()))
        request.seqs.append(self._new_sequence(request, 0, list(prompt_ids)))
        request.forked = params.n == 1
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])
        return request_id

    def prepare_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt, or ValueError saying why it cannot be served."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be hfaccel.SamplingParams; got {type(params).__name__}")
        params.validate()
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} completions cannot run at once: the engine runs at most max_num_seqs="
                             f"{self.scheduler.max_num_seqs} sequences")
        text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        return text, prompt_ids

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        request = self.requests.get(str(request_id))
        if request is None or request.finished:
            return False
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

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
        """Run one step; returns the live requests it changed, copying nothing (``DeltaTracker`` reads the
        new part of each: what ``generate``, ``stream`` and ``AsyncEngine`` use, so a step costs the same
        however long the outputs already are)."""
        plan = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for seq in plan.out_of_blocks:
            self._finish(seq, "length")  # alone in the pool and out of blocks: the pool is the limit
            touched[seq.request.request_id] = seq.request
        if plan.chunks:
            self.runner.cache.copy_blocks(plan.copies)
            for seq, token, logprob in self._forward(plan.chunks):
                self._append_token(seq, token, logprob)
                touched[seq.request.request_id] = seq.request
        return list(touched.values())

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] |
                 None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order.

        A prompt that cannot be served (empty, too long, bad token ids) gets an output with ``error`` set and
        ``finish_reason="error"``; the others run normally.
        """
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids: list[str | RequestOutput] = []
        for prompt, param in zip(prompts, params):
            try:
                ids.append(self.add_request(prompt, param))
            except ValueError as error:
                ids.append(_error_output(prompt, error))
        while self.has_unfinished_requests():
            self.step_requests()
        outputs = [self.snapshot(self.requests[i]) if isinstance(i, str) else i for i in ids]
        for i in ids:
            if isinstance(i, str):
                self.release(i)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield what is new for this request after each step (other queued requests advance too).

        Each yielded output holds only the new text and token ids of each completion; the last one has
        ``finished=True``. Closing the iterator early aborts the request.
        """
        request_id = self.add_request(prompt, params)
        seen = DeltaTracker()
        try:
            while True:
                request = self.requests[request_id]
                if not request.finished:
                    self.step_requests()
                delta = seen.delta(request)
                if delta is not None:
                    yield delta
                if request.finished:
                    return
        finally:
            self.abort(request_id)
            self.release(request_id)

    # ------------------------------------------------------------------------------------------- state
    def snapshot(self, request: Request) -> RequestOutput:
        """The request's outputs so far (text held back where a stop string might still begin)."""
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            out = seq.output
            finished = out.finish_reason is not None
            text = seq.detokenizer.stable_text(finished) if seq.detokenizer is not None else ""
            outputs.append(CompletionOutput(out.index, text, list(out.token_ids),
                                            None if out.logprobs is None else list(out.logprobs),
                                            out.finish_reason, out.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, metrics=request.metrics)

    def stats(self) -> dict[str, int]:
        manager = self.scheduler.manager
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_total": manager.num_blocks, "blocks_used": manager.num_used_blocks,
                "blocks_free": manager.num_free_blocks}

    # --------------------------------------------------------------------------------------- internals
    def _forward(self, chunks: list[ScheduledChunk]) -> list[tuple[Seq, int, TokenLogprob | None]]:
        """One packed forward of the chunks; sample every sequence whose last token was computed."""
        now = time.perf_counter()
        flat = [t for c in chunks for t in c.seq.token_ids[c.start:c.start + c.length]]
        completing = [i for i, c in enumerate(chunks) if c.completes]
        seq_ids, starts = [c.seq.seq_id for c in chunks], [c.start for c in chunks]
        if self.graphs is not None and len(flat) == len(completing) and self.graphs.serves(len(chunks)):
            logits = self.graphs.run(seq_ids, flat, starts)  # decode only: one token per sequence
        else:
            logits = self.runner.forward(seq_ids, torch.tensor(flat, dtype=torch.long), [c.length for c in chunks],
                                         starts=starts, logits_for=completing)  # [C, V]
        sampled = self._sample(logits, [chunks[i].seq for i in completing])
        # only now that nothing can fail does the step count (a failed step is simply recomputed)
        manager = self.scheduler.manager
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
            manager.mark_computed(chunk.seq.seq_id, chunk.seq.num_computed)
            if chunk.seq.request.metrics.first_scheduled_time is None:
                chunk.seq.request.metrics.first_scheduled_time = now
        return sampled

    def _sample(self, logits: torch.Tensor, seqs: list[Seq]) -> list[tuple[Seq, int, TokenLogprob | None]]:
        """Next tokens of the sequences whose last token was computed (``logits`` row i is ``seqs[i]``'s)."""
        targets = [(row, target) for row, seq in enumerate(seqs) for target in self._sampling_sequences(seq)]
        if not targets:
            return []
        rows = [SampleRow(seq.request.params, seq.generator, seq.request.prompt_token_ids, seq.output_ids)
                for _, seq in targets]
        tokens, logprobs = sample(logits[torch.tensor([r for r, _ in targets], device=logits.device)], rows)
        return [(seq, token, logprob) for (_, seq), token, logprob in zip(targets, tokens, logprobs)]

    def _sampling_sequences(self, seq: Seq) -> list[Seq]:
        """The sequences that sample from this sequence's logits: itself, plus its n - 1 siblings the first
        time its prompt is computed (they share its blocks)."""
        request = seq.request
        if request.forked:
            return [seq]
        request.forked = True
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index, list(seq.token_ids))
            self.scheduler.manager.fork(seq.seq_id, child.seq_id)
            child.num_computed = seq.num_computed
            request.seqs.append(child)
            self.scheduler.add_running(child)
        return list(request.seqs)

    def _append_token(self, seq: Seq, token: int, logprob: TokenLogprob | None) -> None:
        params, out, now = seq.request.params, seq.output, time.perf_counter()
        seq.token_ids.append(token)
        out.token_ids.append(token)
        if logprob is not None:
            out.logprobs.append(logprob)
        metrics = seq.request.metrics
        if seq.index == 0:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.token_times.append(now)
        if token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if token in self.eos_token_ids and not params.ignore_eos:
            return self._finish(seq, "stop", token)
        stop = seq.detokenizer.add(token) if seq.detokenizer is not None else None
        if stop is not None:
            return self._finish(seq, "stop", stop)
        if len(out.token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length")
        return None

    def _finish(self, seq: Seq, reason: str, stop_reason: str | int | None = None) -> None:
        seq.output.finish_reason, seq.output.stop_reason = reason, stop_reason
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.detokenizer.flush()  # a stop string already cut the text
        self.scheduler.finish(seq)
        if seq.request.finished:
            seq.request.metrics.finished_time = time.perf_counter()

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Seq:
        params = request.params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                                 params.skip_special_tokens)
        generator = None
        if params.seed is not None:
            seed = (params.seed + 7919 * index) % (1 << 63)  # any int seed; a distinct stream per completion
            generator = torch.Generator(self.runner.device).manual_seed(seed)
        output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        return Seq(next(self._seq_ids), request, index, token_ids, output, detokenizer, generator)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self._need_tokenizer("text prompts")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            self._need_tokenizer("chat messages")
            try:
                ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            except Exception as error:  # jinja2 template errors ("roles must alternate", ...)
                raise ValueError(f"the tokenizer's chat template rejected the messages: {error}") from None
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return None, [int(t) for t in ids]
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a list of chat messages (dicts); got "
                         f"{type(prompt).__name__}")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got values from {min(ids)} to "
                             f"{max(ids)}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                             f"(prompt + at least one new token must fit)")
        manager = self.scheduler.manager
        if manager.blocks_needed(len(ids) + 1) > manager.num_blocks:
            raise ValueError(f"the prompt needs {manager.blocks_needed(len(ids) + 1)} KV blocks; the pool has "
                             f"{manager.num_blocks} in all")

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} need the engine's tokenizer (Engine(model, tokenizer)); give token ids "
                             f"instead")


class DeltaTracker:
    """What is new in one request since the last call: new text and tokens per completion (read from the
    live request, so the cost follows the new tokens, not the output's length)."""

    def __init__(self):
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, request: Request) -> RequestOutput | None:
        outputs = [delta for seq in sorted(request.seqs, key=lambda s: s.index)
                   if (delta := self._completion_delta(seq)) is not None]
        if not outputs and not request.finished:
            return None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, metrics=request.metrics)

    def _completion_delta(self, seq: Seq) -> CompletionOutput | None:
        out = seq.output
        if out.index in self.done:
            return None
        finished = out.finish_reason is not None
        detokenizer = seq.detokenizer
        end = detokenizer.stable_length(finished) if detokenizer is not None else 0
        text_at, token_at = self.text.get(out.index, 0), self.tokens.get(out.index, 0)
        if end == text_at and len(out.token_ids) == token_at and not finished:
            return None
        text = detokenizer.text[text_at:end] if detokenizer is not None else ""
        delta = CompletionOutput(out.index, text, out.token_ids[token_at:],
                                 None if out.logprobs is None else out.logprobs[token_at:], out.finish_reason,
                                 out.stop_reason)
        self.text[out.index], self.tokens[out.index] = end, len(out.token_ids)
        if finished:
            self.done.add(out.index)
        return delta


def _ensure_accelerated(model) -> None:
    import hfaccel

    info = getattr(model, "hfaccel", None)
    if info is None:
        hfaccel.accelerate(model, paged=False)
        info = model.hfaccel
    if not info.active:
        raise ValueError(f"hfaccel.Engine cannot serve {type(model).__name__}: {info.fallback_reason}")


def _default_num_blocks(model, block_size: int, max_num_seqs: int, max_model_len: int, fraction: float) -> int:
    from hfaccel.cache import kv_dims

    layers, kv_heads, head_dim = kv_dims(model.config)
    block_bytes = layers * 2 * block_size * kv_heads * head_dim * model.dtype.itemsize
    device = next(model.parameters()).device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * fraction) // block_bytes)
    wanted = max_num_seqs * -(-min(max_model_len, 2048) // block_size)
    return max(1, min(wanted, CPU_POOL_BYTES // block_bytes))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set([] if ids is None else [ids] if isinstance(ids, int) else ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str) or isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        first = prompts[0]
        return isinstance(first, int) or isinstance(first, dict)
    return False


def _error_output(prompt, error: Exception) -> RequestOutput:
    return RequestOutput("", prompt if isinstance(prompt, str) else None, [],
                         [CompletionOutput(0, finish_reason="error")], finished=True, error=str(error))

