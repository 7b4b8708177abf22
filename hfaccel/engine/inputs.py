"""What the engine takes in: prompts tokenized and checked, sampling parameters checked, requests and their sequences
made.

A prompt is text, token ids, chat messages (through the tokenizer's chat template, or an image-text-to-text model's
processor) or, with images, ``{"prompt": text_or_messages, "images": [...]}`` (``hfaccel.engine.media``). Everything
a request brings is checked here, before it can join a batch, so a bad value never fails a step:
:class:`PreparedPrompt` is a request that passed, which the engine queues without checking it again.
"""

from __future__ import annotations

import collections.abc
import itertools
import time
from dataclasses import dataclass

import torch

from hfaccel.attention import is_image_text_to_text
from hfaccel.engine.media import MediaInputs, process, processed_media
from hfaccel.engine.outputs import CompletionOutput, RequestMetrics
from hfaccel.engine.prompt_logprobs import empty_prompt_logprobs
from hfaccel.engine.scheduler import Request, Sequence
from hfaccel.kv import KVPool
from hfaccel.lora import LoRAAdapter, LoRAManager
from hfaccel.sampling import IncrementalDetokenizer, InvalidSamplingParams, SamplingParams, StopChecker
from hfaccel.sampling.structured import Grammars, shared_grammars

# a text prompt, token ids, chat messages, or (image-text-to-text models) {"prompt": text or messages, "images": [...]}
Prompt = str | collections.abc.Sequence[int] | collections.abc.Sequence[dict] | dict


@dataclass(frozen=True)
class PreparedPrompt:
    """A request checked against an engine and tokenized (:meth:`Engine.prepare_prompt`): the engine queues it
    without checking or tokenizing it again."""

    text: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs through (None: the base model)
    media: MediaInputs | None = None  # its images' inputs (an image-text-to-text model's processor made them)

    def check_call(self, params: SamplingParams | None, lora: str | None) -> None:
        """ValueError where a call passing this prompt gives other parameters or another adapter than it carries."""
        if params is not None and params is not self.params:
            raise ValueError("a PreparedPrompt carries its own SamplingParams; pass params=None")
        if lora is not None and (self.lora is None or self.lora.name != lora):
            raise ValueError(
                "a PreparedPrompt carries its own LoRA adapter; pass lora=None (or prepare it with lora=...)"
            )


class Intake:
    """Prompts and parameters checked against one engine's model and limits, and the requests made of them.

    ``processor``: an image-text-to-text model's processor (None: prompts without images only); ``pool``: the
    engine's KV pool (a prompt must fit it); ``loras``: the engine's LoRA adapters, if any (an image request's
    adapter must leave the vision tower alone).
    """

    def __init__(
        self,
        model,
        processor,
        tokenizer,
        pool: KVPool,
        *,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        eos_token_ids: set[int],
        loras: LoRAManager | None,
    ):
        self.model, self.processor, self.tokenizer, self.pool = model, processor, tokenizer, pool
        self.vocab_size, self.max_model_len, self.max_num_seqs = vocab_size, max_model_len, max_num_seqs
        self.eos_token_ids, self.loras = eos_token_ids, loras
        self._seq_ids = itertools.count()

    # -------------------------------------------------------------------------------------------- prompts
    def prepare_prompt(self, prompt: Prompt, params: SamplingParams, adapter: LoRAAdapter | None) -> PreparedPrompt:
        """The request checked and tokenized once, or a ValueError saying why it cannot be served."""
        self.check_params(params)
        if _has_images(prompt):
            text, ids, media = self.process_prompt(prompt)
            return self.prepared(text, ids, params, adapter, media, params_checked=True)
        return self.prepared(*self.tokenize_prompt(prompt), params, adapter, params_checked=True)

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt the engine can hold, or a ValueError saying why not."""
        text, prompt_ids = self.tokenize(prompt)
        self._check_prompt(prompt_ids)
        return text, prompt_ids

    def prepared(
        self,
        text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: LoRAAdapter | None,
        media: MediaInputs | None = None,
        *,
        params_checked: bool = False,
    ) -> PreparedPrompt:
        """A :class:`PreparedPrompt` of ids :meth:`tokenize_prompt` (or :meth:`process_prompt`, with its ``media``)
        gave, ``params`` checked (unless they were)."""
        if not params_checked:
            self.check_params(params)
        self.check_media(media, adapter)
        if media is not None:
            media = media.located(prompt_ids, self.model.config)
        return PreparedPrompt(text, tuple(prompt_ids), params, adapter, media)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt without images, unchecked."""
        if isinstance(prompt, str):
            self._need_tokenizer("text prompts")
            check_text(prompt, "the prompt")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.processor is not None:  # a multimodal model's chat template is its processor's
                text, ids, _ = self.process_prompt(prompt)
                return text, ids
            self._need_tokenizer("chat messages")
            for i, message in enumerate(prompt):
                for key, value in message.items():
                    if isinstance(value, str):
                        check_text(value, f"message {i}'s {key!r}")
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
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a list of chat messages (dicts); got "
            f"{type(prompt).__name__}"
        )

    def process_prompt(self, prompt: Prompt, **template) -> tuple[str | None, list[int], MediaInputs | None]:
        """(prompt text, token ids, multimodal inputs or None) of a prompt with images (or chat messages), by the
        processor (``template``: chat-template arguments), or a ValueError saying why it cannot be served."""
        processed = isinstance(prompt, dict) and "prompt_token_ids" in prompt
        if not is_image_text_to_text(self.model) or self.processor is None and not processed:
            raise ValueError(
                "prompts with images need an image-text-to-text model and its processor "
                "(Engine(model, processor)); this engine has "
                + ("no processor" if self.processor is None else f"a {type(self.model).__name__}")
            )
        if processed:
            if sorted(prompt) != ["multimodal_inputs", "prompt_token_ids"]:
                raise ValueError(
                    f"a processed prompt dict has the keys 'prompt_token_ids' and 'multimodal_inputs'; "
                    f"got {sorted(prompt)}"
                )
            text, ids, media = (
                None,
                self.tokenize(prompt["prompt_token_ids"])[1],
                processed_media(prompt["multimodal_inputs"]),
            )
        elif isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "images"})
            if unknown or "prompt" not in prompt:
                raise ValueError(f"a prompt dict has the keys 'prompt' and 'images'; got {sorted(prompt)}")
            text, ids, media = process(self.processor, prompt["prompt"], prompt.get("images"), **template)
        else:
            text, ids, media = process(self.processor, prompt, None, **template)
        self._check_prompt(ids)
        return text, ids, media

    # --------------------------------------------------------------------------------------------- checks
    def check_params(self, params: SamplingParams) -> None:
        """Raise :class:`~hfaccel.sampling.InvalidSamplingParams` (a ValueError) if the engine cannot serve
        ``params``: every value within what the model's vocabulary and the engine's limits hold."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be hfaccel.SamplingParams; got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.structured_outputs is not None:
            self.grammars().compile(params.structured_outputs)  # a spec that does not compile: ValueError now
        if params.n > self.max_num_seqs:
            raise InvalidSamplingParams(
                "n",
                f"n={params.n} completions cannot run at once: the engine runs at "
                f"most max_num_seqs={self.max_num_seqs} sequences",
            )

    def check_media(self, media: MediaInputs | None, adapter: LoRAAdapter | None) -> None:
        """ValueError for what a request with images cannot have yet (a no-op without images)."""
        if media is None:
            return
        outside = [] if adapter is None else self.loras.beyond_language_model(adapter)
        if outside:
            raise ValueError(
                f"requests with images cannot take LoRA adapter {adapter.name!r}: it targets {len(outside)} layers "
                f"outside the language model ({outside[0]}, ...), which hfaccel runs without adapters"
            )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(
                f"prompt token ids must be in [0, {self.vocab_size}); got values from {min(ids)} to {max(ids)}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                f"(prompt + at least one new token must fit)"
            )
        manager = self.pool.manager
        if manager.blocks_needed(len(ids) + 1) > manager.num_blocks:
            raise ValueError(
                f"the prompt needs {manager.blocks_needed(len(ids) + 1)} KV blocks; the pool has "
                f"{manager.num_blocks} in all"
            )

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} need the engine's tokenizer (Engine(model, tokenizer)); give token ids instead")

    def grammars(self) -> Grammars:
        """The compiled grammars of the tokenizer, shared process-wide (indexed on the first structured request)."""
        return shared_grammars(self.tokenizer, self.vocab_size)

    # ------------------------------------------------------------------------------------ requests, sequences
    def request(self, request_id: str, prepared: PreparedPrompt, arrival_time: float | None) -> Request:
        """A new request of ``prepared`` with its first sequence (its ``n - 1`` siblings fork from it later)."""
        prompt_ids, params = list(prepared.prompt_ids), prepared.params
        request = Request(
            request_id,
            prepared.text,
            prompt_ids,
            params,
            RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter()),
            lora=prepared.lora,
            media=prepared.media,
        )
        request.prompt_logprobs = empty_prompt_logprobs(request)
        request.seqs.append(self.new_sequence(request, 0, list(prompt_ids)))
        request.forked = params.n == 1
        return request

    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        """Completion ``index`` of ``request``, holding ``token_ids``, with its stop rules and detokenizer."""
        params = request.params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens
            )
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        budget = min(params.max_tokens, self.max_model_len - request.num_prompt_tokens)  # or the context ends it
        stopper = StopChecker(stop_ids, detokenizer, budget, params.min_tokens)
        output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        # the completion's stream: the request's seed with its index (SampleRow.stream)
        return Sequence(next(self._seq_ids), request, index, token_ids, output, stopper, params.seed)


def check_text(text: str, what: str) -> None:
    """ValueError if ``text`` is not valid Unicode (a lone surrogate, as JSON's "\\ud800" escapes can make)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode text: {error.reason} {text[error.start : error.end]!r} at "
            f"character {error.start}"
        ) from None


def per_prompt(
    prompts: Prompt | collections.abc.Sequence[Prompt],
    params: SamplingParams | collections.abc.Sequence[SamplingParams] | None,
    lora: str | collections.abc.Sequence[str | None] | None,
) -> list[tuple[Prompt, SamplingParams | None, str | None]]:
    """``Engine.generate``'s arguments as (prompt, params, LoRA adapter name) per prompt: ``prompts`` one prompt or a
    list of them, ``params`` and ``lora`` one for all or one per prompt."""
    prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
    if len(loras) != len(prompts):
        raise ValueError(f"got {len(loras)} LoRA adapter names for {len(prompts)} prompts")
    return list(zip(prompts, params, loras))


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, (str, dict)) or isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        first = prompts[0]
        return isinstance(first, int) or isinstance(first, dict) and "role" in first  # chat messages
    return False


def _has_images(prompt) -> bool:
    """Whether a prompt brings images: a ``{"prompt", "images"}`` dict, or chat messages with image parts."""
    if isinstance(prompt, dict):
        return True
    return isinstance(prompt, (list, tuple)) and any(
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") == "image" for part in message["content"])
        for message in prompt
    )
