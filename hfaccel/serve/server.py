"""``hfaccel serve``: an OpenAI-compatible HTTP service over :class:`AsyncEngine` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as server-sent
events in OpenAI's chunk format, ending with ``data: [DONE]``), ``POST /v1/responses`` (OpenAI's Responses API,
streamed as its own events; ``hfaccel.serve.responses``) and ``GET /v1/responses/{id}``, ``GET /v1/models``,
vLLM's ``POST /tokenize`` and ``/detokenize``, ``GET /version``, ``GET /health`` and ``GET /metrics`` (Prometheus
text format, from a registry of this app's own). Chat requests carry tools, tool choices and reasoning
(``hfaccel.serve.chat``: the model's chat template renders them, its output becomes the assistant message).
Every answer carries an ``X-Request-Id`` header; ``allowed_origins`` turns CORS on.

With LoRA adapters (``hfaccel serve BASE --lora name=path``), a request's ``model`` names the adapter it runs through
(the served model's own name: the base model); ``/v1/models`` lists the base and each adapter (``parent``: the base).

Every failure is an OpenAI-style JSON error (``{"error": {"message", "type", "param", "code"}}``): malformed
JSON or UTF-8 (nesting too deep, numbers too long included), wrongly typed fields (strictly: ``true`` is not a
number, ``"yes"`` not a bool) and values :meth:`Engine.check_params` refuses (a ``response_format`` or
``structured_outputs`` grammar that does not compile included) → 400, a missing or wrong bearer
token → 401, an unknown model or route → 404, a wrong method → 405, a body slower than ``read_timeout`` → 408,
a body over the size limit → 413 (from ``Content-Length`` before reading, else as soon as the chunks read add
up to more), more requests in flight than ``max_queue`` → 429 at once, a request the engine failed → 500, a
request over ``request_timeout`` → 408, the end of shutdown's grace period → 503 (mid-stream: a final error
event, then ``[DONE]``), each with the request aborted. A client that disconnects, streamed or not, has its
request aborted and its KV blocks freed (counted in ``/metrics`` as status 499). Headers that do not arrive
within ``read_timeout`` close the connection (``hfaccel.serve.http``). One bad request never affects the others.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from hfaccel.engine import AsyncEngine, CompletionOutput
from hfaccel.engine.engine import check_text
from hfaccel.serve.config import ServerConfig, ServerState
from hfaccel.serve.engine_calls import run_call
from hfaccel.serve.errors import APIError, quoted
from hfaccel.serve.middleware import AuthorizeAndCountMiddleware, RequestIdMiddleware
from hfaccel.serve.prompts import (chat_tools_and_messages, fetch_images, plan_chat, prepare_prompt, prompt_list,
                                   refuse_unsupported_fields, render_conversation, requested_adapter)
from hfaccel.serve.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest, message_dicts)
from hfaccel.serve.request_body import parsed_body
from hfaccel.serve.responses import ResponsesRequest, ResponsesShaper, input_messages
from hfaccel.serve.shaping import CallShaper, finish_reason, usage_of
from hfaccel.serve.tools import ToolError, parse_tool_choice, parse_tools

__all__ = ["ServerConfig", "create_app", "serve"]

FINAL_WRITE_S = 5.0  # after shutdown's grace period: time to write the final events before uvicorn cancels


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine`` (shut down with the app)."""
    state = ServerState.serving(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, True)

    app = FastAPI(title="hfaccel", lifespan=lifespan)
    app.state.hfaccel = state
    app.add_middleware(AuthorizeAndCountMiddleware, state=state)
    app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:  # outermost: a browser's preflight is answered before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    _answer_errors_in_openai_format(app)
    _add_service_routes(app, state)
    _add_api_routes(app, state)
    return app


def _answer_errors_in_openai_format(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(http_request: Request, error: APIError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(http_request: Request, error: HTTPException):  # unknown routes (404), wrong methods (405)
        message = f"{error.detail}: {http_request.method} {http_request.url.path}"
        return APIError(error.status_code, message, headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(http_request: Request, error: RequestValidationError):
        return APIError(400, f"invalid request: {quoted(error.errors())}").response()

    @app.exception_handler(Exception)
    async def internal_error(http_request: Request, error: Exception):  # a bug: still an OpenAI-shaped answer
        return APIError(500, f"internal server error: {type(error).__name__}").response()


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    """``/health``, ``/metrics`` and ``/version``: for load balancers, monitoring and people."""
    engine = state.engine

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down", **engine.stats()}, status_code=503)
        if not engine.healthy:
            return JSONResponse({"status": "unavailable", **engine.stats()}, status_code=503)
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("hfaccel")}


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's ``/v1/*`` routes and vLLM's ``/tokenize`` and ``/detokenize``."""
    config = state.config

    @app.get("/v1/models")
    async def models():
        base = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "hfaccel"}
        loras = state.engine.engine.loras
        # one snapshot: the engine thread may remove an adapter meanwhile
        adapters = [] if loras is None else sorted(list(loras.adapters.values()), key=lambda adapter: adapter.name)
        return {"object": "list", "data": [base] + [
            {**base, "id": adapter.name, "root": adapter.path, "parent": config.model_name} for adapter in adapters]}

    for path, model, handler in (("/v1/completions", CompletionRequest, _completions),
                                 ("/v1/chat/completions", ChatCompletionRequest, _chat_completions),
                                 ("/v1/responses", ResponsesRequest, _responses)):
        app.add_api_route(path, _generating(state, model, handler), methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        record = state.responses.get(response_id)
        if record is None:
            raise APIError(404, f"no stored response has the id {response_id!r:.80}", param="response_id",
                           code="response_not_found")
        return record.body

    @app.post("/tokenize")
    async def tokenize(http_request: Request):
        return await _tokenize(state, await parsed_body(TokenizeRequest, http_request, config))

    @app.post("/detokenize")
    async def detokenize(http_request: Request):
        return _detokenize(state, await parsed_body(DetokenizeRequest, http_request, config))


def _generating(state: ServerState, model: type[BaseModel], handler):
    """The endpoint of a generating route: its body parsed as ``model``, then ``handler(state, body, http_request)``."""

    async def endpoint(http_request: Request):
        return await handler(state, await parsed_body(model, http_request, state.config), http_request)

    return endpoint


async def _completions(state: ServerState, body: CompletionRequest, http_request: Request):
    """``POST /v1/completions``: each prompt's ``n`` completions (the best ``n`` of ``best_of``)."""
    lora = requested_adapter(state, body.model)
    refuse_unsupported_fields(body)
    best_of = body.n if body.best_of is None else body.best_of
    if best_of < body.n or best_of != body.n and body.stream:
        raise APIError(400, f"best_of must be at least n={body.n}, and equal to it when streaming; got {best_of}",
                       param="best_of")
    # the prompt's logprobs: echoed with the output's (OpenAI's echo), or vLLM's prompt_logprobs field
    prompt_logprobs = max((n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None),
                          default=None)
    # best_of ranks its completions by their tokens' logprobs
    logprobs = body.logprobs if best_of == body.n else (body.logprobs or 0)
    prompts = [await prepare_prompt(state, p, body.max_new_tokens,
                                    lambda m: body.sampling_params(m, logprobs, n=best_of,
                                                                   prompt_logprobs=prompt_logprobs),
                                    structured_param=body.structured_field, lora=lora)
               for p in prompt_list(body.prompt)]
    shaper = CallShaper(state.engine.engine.tokenizer, "cmpl", "text_completion", body.n, chat=False,
                        model=body.model, echo=body.echo, prompt_logprobs=body.prompt_logprobs is not None)
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for i, output in enumerate(outputs):
        for rank, completion in enumerate(_best_completions(output.outputs, body.n)):
            entries = None if body.logprobs is None else completion.logprobs
            choices.append(shaper.completion_choice(i * body.n + rank, output, completion, entries))
    return shaper.answer(choices, usage_of(outputs))


async def _chat_completions(state: ServerState, body: ChatCompletionRequest, http_request: Request):
    """``POST /v1/chat/completions``: the conversation through the model's chat template, ``n`` assistant
    messages back."""
    lora = requested_adapter(state, body.model)
    refuse_unsupported_fields(body)
    tools, messages = await chat_tools_and_messages(state, body)
    try:
        choice = parse_tool_choice(body.tool_choice, tools)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    plan = await plan_chat(state, body, messages, tools, choice, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompts = [await prepare_prompt(state, plan.ids, body.max_new_tokens,
                                    lambda m: body.sampling_params(m, logprobs, structured=plan.structured),
                                    param="messages", structured_param=plan.structured_param, lora=lora,
                                    media=plan.media)]
    shaper = CallShaper(state.engine.engine.tokenizer, "chatcmpl", "chat.completion", body.n, chat=True,
                        model=body.model, shape=plan.shape)
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for completion in outputs[0].outputs:
        message, called = plan.shape.message(completion.text)
        choices.append({"index": completion.index, "message": message,
                        "logprobs": shaper.chat_logprobs(completion.logprobs),
                        "finish_reason": finish_reason(completion.finish_reason, called)})
    return shaper.answer(choices, usage_of(outputs))


async def _responses(state: ServerState, body: ResponsesRequest, http_request: Request):
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
        raise APIError(400, f"input: {quoted(error.errors()) if isinstance(error, ValidationError) else error}",
                       param="input") from None
    instructions = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    await fetch_images(state, new)
    plan = await plan_chat(state, body, instructions + history + new, tools, choice)
    prompts = [await prepare_prompt(state, plan.ids, body.max_output_tokens,
                                    lambda m: body.sampling_params(m, None, structured=plan.structured),
                                    param="input", structured_param=plan.structured_param, lora=lora,
                                    media=plan.media)]
    shaper = ResponsesShaper(state.engine.engine.tokenizer, state.responses, body, plan.shape, history + new)
    outputs = await run_call(state, shaper, body, prompts, http_request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    return shaper.complete(outputs[0])


async def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
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
        _, ids, _ = await render_conversation(state, messages, tools, add_generation_prompt=body.add_generation_prompt,
                                              continue_final_message=body.continue_final_message,
                                              template_arguments=body.chat_template_kwargs)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def _detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """vLLM's ``/detokenize``: token ids back to text."""
    if body.model is not None:
        requested_adapter(state, body.model)
    engine = state.engine.engine
    if engine.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer", param="tokens")
    bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is not a token id of this model (0 to {engine.vocab_size - 1})",
                       param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def _continued_conversation(state: ServerState, previous_response_id: str | None) -> list[dict]:
    """The messages of the stored response a Responses request continues (none without
    ``previous_response_id``), or a 400 when it is not kept."""
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None:
        capacity = state.responses.capacity
        reason = "this server keeps none (--max-stored-responses 0)" if capacity == 0 else \
            f"it is not among the {capacity} this server keeps (or was made with store=false)"
        raise APIError(400, f"previous_response_id {previous_response_id!r:.80}: no such stored response; "
                            f"{reason}", param="previous_response_id", code="previous_response_not_found")
    return stored.messages


def _best_completions(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The ``n`` completions of the highest total logprob (all of them, in order, when there are only ``n``)."""
    if len(completions) == n:
        return completions
    return sorted(completions, key=lambda c: -sum(entry.logprob for entry in c.logprobs or []))[:n]


def serve(engine: AsyncEngine, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
          graceful_shutdown_s: float = 30.0, log_level: str = "info") -> None:
    """Run the server until SIGINT / SIGTERM: new connections stop and new requests get 503, in-flight requests
    get ``graceful_shutdown_s`` to finish, the rest end cleanly (streams with an error event and ``[DONE]``,
    others with a JSON 503) and are aborted, then the engine stops."""
    import signal

    import uvicorn

    from hfaccel.serve.http import DrainingServer, h11_with_header_deadline

    app = create_app(engine, config)
    server = DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level,
                       http=h11_with_header_deadline(config.read_timeout),
                       timeout_graceful_shutdown=graceful_shutdown_s + FINAL_WRITE_S),
        on_shutdown=lambda: app.state.hfaccel.drain(graceful_shutdown_s))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the previous handler: make that
    # an exit with status 0, so process supervisors see a clean stop
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server.run()
    if not server.started:
        raise SystemExit(f"hfaccel serve: the server could not start on {host}:{port} (see the log above)")


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
