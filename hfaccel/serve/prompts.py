"""A generating request's prompts, checked once by the engine's own rules before any is admitted: the model (or
LoRA adapter) it names, the OpenAI fields this server refuses, a chat rendered by the model's template with its
tools, images and answer constraint, and each prompt tokenized with its sampling parameters. What is wrong is a
400 (404: an unknown model) naming the field."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from hfaccel.engine import PreparedPrompt
from hfaccel.engine.media import MAX_IMAGES, MediaInputs
from hfaccel.lora import LoRAAdapter
from hfaccel.sampling import InvalidSamplingParams
from hfaccel.serve.chat import ChatShape, render_chat
from hfaccel.serve.config import ServerState
from hfaccel.serve.errors import APIError
from hfaccel.serve.media import image_bytes
from hfaccel.serve.protocol import ChatCompletionRequest, SamplingRequest, TokenizeRequest, image_parts, message_dicts
from hfaccel.serve.tools import Tool, ToolError, constrained_schema, parse_tools


def requested_adapter(state: ServerState, model: str) -> LoRAAdapter | None:
    """The LoRA adapter a request's ``model`` names (None: the served model itself), or a 404."""
    if model == state.config.model_name:
        return None
    engine = state.engine.engine
    adapter = None if engine.loras is None else engine.loras.adapters.get(model)
    if adapter is None:
        served = ", ".join(repr(n) for n in [state.config.model_name, *engine.list_loras()])
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served}",
            code="model_not_found",
            param="model",
        )
    return adapter


def refuse_unsupported_fields(body: SamplingRequest, also: tuple[str, ...] = ()) -> None:
    """A 400 naming the first OpenAI field of the request this server does not implement (``protocol.REFUSED``)."""
    name = body.refused_field(also)
    if name is not None:
        raise APIError(
            400,
            f"{name} is not supported by this server (its value would change the output; send it unset)",
            param=name,
        )


def prompt_list(prompt) -> list:
    """A completions ``prompt`` field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(prompt)


async def prepare_prompt(
    state: ServerState,
    prompt,
    max_tokens: int | None,
    params_for,
    param: str = "prompt",
    structured_param: str = "structured_outputs",
    lora: LoRAAdapter | None = None,
    media: MediaInputs | None = None,
) -> PreparedPrompt:
    """One prompt tokenized (in a worker thread: a long prompt never stalls the other streams) and checked once,
    by the engine's own rules, with its sampling parameters (``params_for(max_tokens)``; ``max_tokens`` None: the
    rest of the context), or a 400 saying what is wrong (``structured_param``: the field a structured-outputs spec
    that does not compile came from). ``lora``: the LoRA adapter it runs through (None: the base model);
    ``media``: the images' inputs of a chat prompt (token ids) the processor made."""
    engine = state.engine.engine
    try:
        text, ids = await asyncio.to_thread(engine.tokenize_prompt, prompt)
    except ValueError as error:
        code = "context_length_exceeded" if "context" in str(error) else None
        raise APIError(400, str(error), param=param, code=code) from None
    room = engine.max_model_len - len(ids)
    max_tokens = room if max_tokens is None else max_tokens
    if max_tokens > room:
        raise APIError(
            400,
            f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
            f"context is {engine.max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        params = params_for(max_tokens)
        engine.check_media(media, lora)
    except InvalidSamplingParams as error:
        raise APIError(400, str(error), param=error.param) from None
    except ValueError as error:
        raise APIError(400, str(error), param=param) from None
    try:
        if params.structured_outputs is None:
            return engine.prepared(text, ids, params, lora=lora, media=media)
        # compiling a grammar can take a while (the first one also indexes the vocabulary): in a worker thread
        return await asyncio.to_thread(engine.prepared, text, ids, params, lora=lora, media=media)
    except InvalidSamplingParams as error:
        raise APIError(400, str(error), param=error.param) from None
    except ValueError as error:  # a structured-outputs spec that does not compile: the compiler's message
        raise APIError(400, str(error), param=structured_param) from None
    except ImportError as error:  # structured outputs without xgrammar installed
        raise APIError(
            400, f"structured outputs are not available on this server: {error}", param=structured_param
        ) from None


@dataclass(frozen=True)
class ChatPlan:
    """A chat-shaped call's prompt, how its outputs become messages, and the constraint of its answer."""

    ids: list[int]
    shape: ChatShape
    structured: dict | None  # SamplingParams.structured_outputs: the tool calls' or the request's own constraint
    structured_param: str  # the request field a constraint that does not compile came from
    media: MediaInputs | None = None  # the prompt's images, as the model's processor made them


async def plan_chat(
    state: ServerState,
    body: SamplingRequest,
    messages: list[dict],
    tools: list[Tool],
    choice: str | Tool,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> ChatPlan:
    """The prompt rendered by the model's chat template, and the answer's constraint: a ``required`` or named tool
    choice's calls, else the request's own structured outputs — after the output's reasoning where the model
    reasons (the reasoning tags are single tokens), else from its first token with no reasoning split out."""
    schema = constrained_schema(choice, tools, body.parallel_tool_calls)
    try:
        own = body.structured_request()
    except InvalidSamplingParams as error:
        raise APIError(400, str(error), param=error.param) from None
    if schema is not None and own is not None:
        raise APIError(
            400,
            f"tool_choice={_shown_choice(choice)} constrains the output to tool calls; it cannot also "
            f"follow {body.structured_field}",
            param="tool_choice",
        )
    prompt, ids, media = await render_conversation(
        state,
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_arguments=body.chat_template_kwargs,
    )
    shape = ChatShape.of(choice, state.tool_parser, state.reasoning, prompt, schema is not None)
    structured = {"json": schema} if schema is not None else own
    if structured is not None and shape.reasoning is not None and "reasoning" not in structured:
        if state.reasoning_tags_are_tokens:
            structured = {**structured, "reasoning": shape.reasoning}
        else:  # the grammar cannot wait for a multi-token tag: the answer is constrained from its first token
            shape = replace(shape, reasoning=None)
    return ChatPlan(ids, shape, structured, "tools" if schema is not None else body.structured_field, media)


async def render_conversation(
    state: ServerState, messages: list[dict], tools: list[Tool], **template
) -> tuple[str, list[int], MediaInputs | None]:
    """(prompt text, token ids, images' inputs) of a conversation through the chat template (in a worker thread),
    or a 400."""
    try:
        return await asyncio.to_thread(render_chat, state.engine.engine, messages, tools, **template)
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None


async def chat_tools_and_messages(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest
) -> tuple[list[Tool], list[dict]]:
    """A chat request's tools and messages as the chat template takes them, their images fetched; a 400 naming
    what is malformed."""
    try:
        tools = parse_tools(body.tools)
        messages = message_dicts(body.messages)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    await fetch_images(state, messages)
    return tools, messages


async def fetch_images(state: ServerState, messages: list[dict]) -> None:
    """Put each image part's encoded image in place of its URL (``data:`` decoded, http(s) fetched in worker
    threads), or a 400 naming the part; a model that takes no images refuses them."""
    parts = image_parts(messages)
    if not parts:
        return
    if state.engine.engine.processor is None:
        raise APIError(
            400,
            f"{parts[0][0]}: the served model takes no images (an image-text-to-text model and its processor do)",
            param="messages",
        )
    if len(parts) > MAX_IMAGES:
        raise APIError(400, f"a request takes at most {MAX_IMAGES} images; got {len(parts)}", param="messages")
    domains = state.config.allowed_media_domains
    try:
        loaded = await asyncio.gather(
            *(asyncio.to_thread(image_bytes, part["url"], domains, where) for where, part in parts)
        )
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    for (_, part), data in zip(parts, loaded):
        del part["url"]
        part["image"] = data


def _shown_choice(choice: str | Tool) -> str:
    return repr(choice.name) if isinstance(choice, Tool) else repr(choice)
