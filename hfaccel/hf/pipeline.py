"""``hfaccel.pipeline``: transformers' text-generation pipeline over an accelerated model, lists served by the
engine.

The returned object is a ``transformers.TextGenerationPipeline`` (same arguments, same output format). A call
with prompts (one or a list; strings or chats) and generation options the engine implements runs all prompts
through :class:`hfaccel.Engine` with continuous batching, tokenized and post-processed by the pipeline's own
``preprocess`` / ``postprocess``, so greedy texts equal transformers' pipeline's. Anything else (beam search,
logits processors, stop sequences kept in the text, streamers...) runs through the pipeline's normal
``generate`` path on the accelerated model.
"""

from __future__ import annotations

import torch
import transformers
from transformers import TextGenerationPipeline

from hfaccel import compat
from hfaccel.engine import Engine
from hfaccel.hf.accelerate import accelerate
from hfaccel.sampling import SamplingParams, token_ids

# the token-changing generate() options (compat.generation_options()) the engine implements
_ENGINE_IMPLEMENTS = frozenset({"num_return_sequences", "repetition_penalty", "min_p"})


class EngineTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` whose calls run on an :class:`hfaccel.Engine` when they can (module docstring)."""

    engine_kwargs: dict = {}

    @property
    def engine(self) -> Engine:
        if getattr(self, "_engine", None) is None:
            self._engine = Engine(self.model, self.tokenizer, **self.engine_kwargs)
        return self._engine

    def __call__(self, text_inputs, **kwargs):
        items = _prompt_items(text_inputs)
        if items is None:
            return super().__call__(text_inputs, **kwargs)
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        plan = self._engine_params(forward_params)
        if plan is None:
            return super().__call__(text_inputs, **kwargs)
        config, max_new_tokens = plan
        model_inputs = [self.preprocess(item, **preprocess_params) for item in items]
        prompts = [inputs["input_ids"][0].tolist() for inputs in model_inputs]
        params = [
            _sampling_params(config, max_new_tokens or config.max_length - len(p), self.engine.vocab_size)
            for p in prompts
        ]
        outputs = self.engine.generate(prompts, params)
        results = []
        for inputs, prompt, output in zip(model_inputs, prompts, outputs):
            if output.error is not None:
                raise ValueError(output.error)
            pad = _pad_id(config)
            longest = max(len(o.token_ids) for o in output.outputs)
            rows = [prompt + o.token_ids + [pad] * (longest - len(o.token_ids)) for o in output.outputs]
            model_outputs = {
                "generated_sequence": torch.tensor([rows]),
                "input_ids": inputs["input_ids"],
                "prompt_text": inputs["prompt_text"],
            }
            results.append(self.postprocess(model_outputs, **postprocess_params))
        return results[0] if _is_single(text_inputs) else results

    def _engine_params(self, forward_params: dict):
        """(GenerationConfig, max_new_tokens or None) when the engine implements this call, else None."""
        forward_params = dict(forward_params)
        if forward_params.pop("prefix_length", 0):
            return None
        config, unused = compat.pipeline_generation_config(self, forward_params)
        if any(value is not None for value in unused.values()):
            return None
        if compat.active_generation_options(config, {}, _ENGINE_IMPLEMENTS):
            return None
        if (config.num_return_sequences or 1) > 1 and not config.do_sample:
            return None  # generate() refuses greedy with several return sequences; let it say so
        return config, config.max_new_tokens


def _sampling_params(config, max_new_tokens: int, vocab_size: int) -> SamplingParams:
    eos = token_ids(config.eos_token_id)
    sampling = bool(config.do_sample)
    top_k = min(config.top_k, vocab_size) if sampling and config.top_k else None  # transformers' top-k clamps too
    return SamplingParams(
        max_tokens=max(1, int(max_new_tokens)),
        temperature=float(config.temperature or 1.0) if sampling else 0.0,
        top_p=float(config.top_p or 1.0) if sampling else 1.0,
        top_k=top_k,
        min_p=float(config.min_p or 0.0) if sampling else 0.0,
        repetition_penalty=float(config.repetition_penalty or 1.0),
        n=int(config.num_return_sequences or 1),
        ignore_eos=True,
        stop_token_ids=eos,
        skip_special_tokens=False,
    )


def _pad_id(config) -> int:
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    return (token_ids(config.eos_token_id) or [0])[0]


def _is_chat(item) -> bool:
    return isinstance(item, (list, tuple)) and bool(item) and all(isinstance(m, dict) for m in item)


def _is_single(text_inputs) -> bool:
    return isinstance(text_inputs, str) or _is_chat(text_inputs)


def _prompt_items(text_inputs):
    """The prompts of a call (str or Chat each), or None for inputs the engine path does not take."""
    from transformers.utils.chat_template_utils import Chat

    if _is_single(text_inputs):
        text_inputs = [text_inputs]
    if not isinstance(text_inputs, (list, tuple)) or not text_inputs:
        return None
    if all(isinstance(t, str) for t in text_inputs):
        return list(text_inputs)
    if all(_is_chat(t) for t in text_inputs):
        return [Chat(list(t)) for t in text_inputs]
    return None


def pipeline(
    task: str = "text-generation",
    model=None,
    tokenizer=None,
    *,
    engine_kwargs: dict | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    **accelerate_kwargs,
) -> EngineTextGenerationPipeline:
    """A transformers text-generation ``Pipeline`` over ``hfaccel.accelerate(model, **accelerate_kwargs)``.

    ``model`` is a loaded causal LM or a model folder / hub id (loaded with ``dtype`` onto ``device``);
    ``tokenizer`` defaults to the model's. Calls with a list of prompts are served by an :class:`Engine`
    (created on first use with ``engine_kwargs``) with continuous batching.
    """
    if task != "text-generation":
        raise ValueError(f"hfaccel.pipeline serves the 'text-generation' task; got {task!r}")
    if model is None:
        raise ValueError("hfaccel.pipeline needs a model (a loaded causal LM or a model folder / hub id)")
    if isinstance(model, str):
        tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(model)
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto")
        if device is not None:
            model = model.to(device)
    accelerate(model, **accelerate_kwargs)
    pipe = transformers.pipeline(
        "text-generation", model=model, tokenizer=tokenizer, pipeline_class=EngineTextGenerationPipeline
    )
    pipe.engine_kwargs = dict(engine_kwargs or {})
    return pipe
