"""What each endpoint does with its parsed request body: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses`` check and prepare their prompts, run them and shape the outputs; vLLM's ``/tokenize`` and
``/detokenize`` answer from the tokenizer."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from hfaccel.engine import CompletionOutput
from hfaccel.engine.inputs import check_text
from hfaccel.serve.config import ServerState
from hfaccel.serve.engine_calls import run_call
from hfaccel.serve.errors import APIError, quoted
from hfaccel.serve.prompts import (
    chat_tools_and_messages,
    fetch_images,
    plan_chat,
    prepare_prompt,
    prompt_list,
    refuse_unsupported_fields,
    render_conversation,
    requested_adapter,
)
from hfaccel.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    message_dicts,
)
from hfaccel.serve.responses import ResponsesRequest, ResponsesShaper, input_messages
from hfaccel.serve.shaping import CallShaper, finish_reason, usage_of
from hfaccel.serve.tools import ToolError, parse_tool_choice, parse_tools


async def completions(state: ServerState, body: CompletionRequest, http_request: Request):
    """``POST /v1/completions``: each prompt's ``n`` completions (the best ``n`` of ``best_of``)."""
    lora = requested_adapter(state, body.model)
    refuse_unsupported_fields(body)
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n or best_of != body.n and body.stream:
        raise APIError(
            400, f"best_of must be at least n={body.n}, and equal to it when streaming; got {best_of}", param="best_of"
        )
    # the prompt's logprobs: echoed with the output's (OpenAI's echo), or vLLM's prompt_logprobs field
    prompt_logprobs = max(
        (n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None), default=None
    )
    # best_of ranks its completions by their tokens' logprobs
    logprobs = body.logprobs if best_of == body.n else (body.logprobs or 0)
    prompts = [
        await prepare_prompt(
            state,
            p,
            body.max_new_tokens,
            lambda m: body.sampling_params(m, logprobs, n=best_of, prompt_logprobs=prompt_logprobs),
            structured_param=body.structured_field,
            lora=lora,
        )
        for p in prompt_list(body.prompt)
    ]
    shaper = CallShaper(
        state.engine.engine.tokenizer,
        "cmpl",
        "text_completion",
        body.n,
        chat=False,
        model=body.model,
        echo=body.echo,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for i, output in enumerate(outputs):
        for rank, completion in enumerate(_best_completions(output.outputs, body.n)):
            entries = None if body.logprobs is None else completion.logprobs
            choices.append(shaper.completion_choice(i * body.n + rank, output, completion, entries))
    return shaper.answer(choices, usage_of(outputs))


async def chat_completions(state: ServerState, body: ChatCompletionRequest, http_request: Request):
    """``POST /v1/chat/completions``: the conversation through the model's chat template, ``n`` assistant
    messages back."""
    lora = requested_adapter(state, body.model)
    refuse_unsupported_fields(body)
    tools, messages = await chat_tools_and_messages(state, body)
    try:
        choice = parse_tool_choice(body.tool_choice, tools)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    plan = await plan_chat(
        state,
        body,
        messages,
        tools,
        choice,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompts = [
        await prepare_prompt(
            state,
            plan.ids,
            body.max_new_tokens,
            lambda m: body.sampling_params(m, logprobs, structured=plan.structured),
            param="messages",
            structured_param=plan.structured_param,
            lora=lora,
            media=plan.media,
        )
    ]
    shaper = CallShaper(
        state.engine.engine.tokenizer,
        "chatcmpl",
        "chat.completion",
        body.n,
        chat=True,
        model=body.model,
        shape=plan.shape,
    )
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for completion in outputs[0].outputs:
        message, called = plan.shape.message(completion.text)
        choices.append(
            {
                "index": completion.index,
                "message": message,
                "logprobs": shaper.chat_logprobs(completion.logprobs),
                "finish_reason": finish_reason(completion.finish_reason, called),
            }
        )
    return shaper.answer(choices, usage_of(outputs))


async def responses(state: ServerState, body: ResponsesRequest, http_request: Request):
    """``POST /v1/responses``: the input (after the stored conversation it continues) as a chat, its output as
    Responses items."""
    lora = requested_adapter(state, body.model)
    refuse_unsupported_fields(body, also=("top_logprobs",))
    if body.n != 1:
        raise APIError(400, f"the Responses API makes one output; got n={body.n}", param="n")
    history = _continued_conversation(state, body.previous_response_id)
    try:
        tools = parse_tools(body.tools, flat=True)
        choice = parse_tool_choice(body.tool_choice, tools, flat=True)
        new = message_dicts([ChatMessage.model_validate(m) for m in input_messages(body.input)])
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    except (ValueError, ValidationError) as error:
        raise APIError(
            400, f"input: {quoted(error.errors()) if isinstance(error, ValidationError) else error}", param="input"
        ) from None
    instructions = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    await fetch_images(state, new)
    plan = await plan_chat(state, body, instructions + history + new, tools, choice)
    prompts = [
        await prepare_prompt(
            state,
            plan.ids,
            body.max_output_tokens,
            lambda m: body.sampling_params(m, None, structured=plan.structured),
            param="input",
            structured_param=plan.structured_param,
            lora=lora,
            media=plan.media,
        )
    ]
    shaper = ResponsesShaper(state.engine.engine.tokenizer, state.responses, body, plan.shape, history + new)
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    return shaper.complete(outputs[0])


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """vLLM's ``/tokenize``: a prompt's ids as ``/v1/completions`` makes them, or chat messages' as
    ``/v1/chat/completions`` renders them."""
    if body.model is not None:
        requested_adapter(state, body.model)
    engine = state.engine.engine
    if engine.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send a prompt or messages (one of them)", param="prompt")
    if body.prompt is not None:
        try:
            check_text(body.prompt, "the prompt")
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        ids = list(engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
    else:
        tools, messages = await chat_tools_and_messages(state, body)
        _, ids, _ = await render_conversation(
            state,
            messages,
            tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_arguments=body.chat_template_kwargs,
        )
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """vLLM's ``/detokenize``: token ids back to text."""
    if body.model is not None:
        requested_adapter(state, body.model)
    engine = state.engine.engine
    if engine.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer", param="tokens")
    bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"tokens: {bad} is not a token id of this model (0 to {engine.vocab_size - 1})", param="tokens"
        )
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def _continued_conversation(state: ServerState, previous_response_id: str | None) -> list[dict]:
    """The messages of the stored response a Responses request continues (none without
    ``previous_response_id``), or a 400 when it is not kept."""
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None:
        capacity = state.responses.capacity
        reason = (
            "this server keeps none (--max-stored-responses 0)"
            if capacity == 0
            else f"it is not among the {capacity} this server keeps (or was made with store=false)"
        )
        raise APIError(
            400,
            f"previous_response_id {previous_response_id!r:.80}: no such stored response; {reason}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.messages


def _best_completions(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The ``n`` completions of the highest total logprob (all of them, in order, when there are only ``n``)."""
    if len(completions) == n:
        return completions
    return sorted(completions, key=lambda c: -sum(entry.logprob for entry in c.logprobs or []))[:n]
