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
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from hfaccel.engine import AsyncEngine, PreparedPrompt, RequestOutput
from hfaccel.engine.async_engine import OutputAccumulator
from hfaccel.engine.engine import check_text
from hfaccel.sampling import TokenLogprob
from hfaccel.serve.admission import Admission, client_disconnected, request_deadline, wait_or_abort
from hfaccel.serve.chat import ChatShape, ChoiceStream
from hfaccel.serve.config import ServerConfig, ServerState
from hfaccel.serve.errors import APIError, engine_error, quoted
from hfaccel.serve.middleware import AuthorizeAndCountMiddleware, RequestIdMiddleware
from hfaccel.serve.prompts import (chat_tools_and_messages, fetch_images, plan_chat, prepare_prompt, prompt_list,
                                   refuse_unsupported_fields, render_conversation, requested_adapter)
from hfaccel.serve.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest, message_dicts)
from hfaccel.serve.request_body import parsed_body
from hfaccel.serve.responses import (OutputItems, ResponsesRequest, StoredResponse, input_messages, response_body,
                                     response_usage)
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

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # unknown routes (404), wrong methods (405)
        message = f"{error.detail}: {request.method} {request.url.path}"
        return APIError(error.status_code, message, headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return APIError(400, f"invalid request: {quoted(error.errors())}").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):  # a bug: still an OpenAI-shaped answer
        return APIError(500, f"internal server error: {type(error).__name__}").response()

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

    @app.get("/v1/models")
    async def models():
        base = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "hfaccel"}
        loras = engine.engine.loras
        # one snapshot: the engine thread may remove an adapter meanwhile
        adapters = [] if loras is None else sorted(list(loras.adapters.values()), key=lambda adapter: adapter.name)
        return {"object": "list", "data": [base] + [
            {**base, "id": adapter.name, "root": adapter.path, "parent": config.model_name} for adapter in adapters]}

    for path, model, handler in (("/v1/completions", CompletionRequest, _completions),
                                 ("/v1/chat/completions", ChatCompletionRequest, _chat),
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
    async def tokenize(request: Request):
        body = await parsed_body(TokenizeRequest, request, config)
        return await _tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parsed_body(DetokenizeRequest, request, config)
        return _detokenize(state, body)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("hfaccel")}

    return app


def _generating(state: ServerState, model: type[BaseModel], handler):
    """The endpoint of a generating route: its body parsed as ``model``, then ``handler(state, body, request)``."""

    async def endpoint(request: Request):
        return await handler(state, await parsed_body(model, request, state.config), request)

    return endpoint


# -------------------------------------------------------------------------------------------- handlers
async def _completions(state: ServerState, req: CompletionRequest, request: Request):
    lora = requested_adapter(state, req.model)
    refuse_unsupported_fields(req)
    best_of = req.n if req.best_of is None else req.best_of
    if best_of < req.n or best_of != req.n and req.stream:
        raise APIError(400, f"best_of must be at least n={req.n}, and equal to it when streaming; got {best_of}",
                       param="best_of")
    # the prompt's logprobs: echoed with the output's (OpenAI's echo), or vLLM's prompt_logprobs field
    prompt_logprobs = max((n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None),
                          default=None)
    # best_of ranks its completions by their tokens' logprobs
    logprobs = req.logprobs if best_of == req.n else (req.logprobs or 0)
    prepared = [await prepare_prompt(state, p, req.max_new_tokens,
                                     lambda m: req.sampling_params(m, logprobs, n=best_of,
                                                                   prompt_logprobs=prompt_logprobs),
                                     structured_param=req.structured_field, lora=lora)
                for p in prompt_list(req.prompt)]
    ctx = _Call(state, "cmpl", "text_completion", req.n, chat=False, model=req.model, echo=req.echo,
                prompt_logprobs=req.prompt_logprobs is not None)
    outputs = await _run(ctx, req, prepared, request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for i, out in enumerate(outputs):
        for rank, o in enumerate(_best(out.outputs, req.n)):
            logprobs = None if req.logprobs is None else o.logprobs
            choices.append(ctx.completion_choice(i * req.n + rank, out, o, logprobs))
    return ctx.body(choices, _usage(outputs))


def _best(outputs: list, n: int) -> list:
    """The ``n`` completions of the highest total logprob (all of them, in order, when there are only ``n``)."""
    if len(outputs) == n:
        return outputs
    return sorted(outputs, key=lambda o: -sum(entry.logprob for entry in o.logprobs or []))[:n]


async def _chat(state: ServerState, req: ChatCompletionRequest, request: Request):
    lora = requested_adapter(state, req.model)
    refuse_unsupported_fields(req)
    tools, messages = await chat_tools_and_messages(state, req)
    try:
        choice = parse_tool_choice(req.tool_choice, tools)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    plan = await plan_chat(state, req, messages, tools, choice, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prepared = [await prepare_prompt(state, plan.ids, req.max_new_tokens,
                                     lambda m: req.sampling_params(m, logprobs, structured=plan.structured),
                                     param="messages", structured_param=plan.structured_param, lora=lora,
                                     media=plan.media)]
    ctx = _Call(state, "chatcmpl", "chat.completion", req.n, chat=True, model=req.model, shape=plan.shape)
    outputs = await _run(ctx, req, prepared, request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = []
    for o in outputs[0].outputs:
        message, called = plan.shape.message(o.text)
        choices.append({"index": o.index, "message": message, "logprobs": ctx.chat_logprobs(o.logprobs),
                        "finish_reason": _finish(o.finish_reason, called)})
    return ctx.body(choices, _usage(outputs))


async def _responses(state: ServerState, req: ResponsesRequest, request: Request):
    """``POST /v1/responses``: the input (after the stored conversation it continues) as a chat, its output as
    Responses items."""
    lora = requested_adapter(state, req.model)
    refuse_unsupported_fields(req, also=("top_logprobs",))
    if req.n != 1:
        raise APIError(400, f"the Responses API makes one output; got n={req.n}", param="n")
    history: list[dict] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            reason = "this server keeps none (--max-stored-responses 0)" if state.responses.capacity == 0 else \
                f"it is not among the {state.responses.capacity} this server keeps (or was made with store=false)"
            raise APIError(400, f"previous_response_id {req.previous_response_id!r:.80}: no such stored response; "
                                f"{reason}", param="previous_response_id", code="previous_response_not_found")
        history = stored.messages
    try:
        tools = parse_tools(req.tools, flat=True)
        choice = parse_tool_choice(req.tool_choice, tools, flat=True)
        new = message_dicts([ChatMessage.model_validate(m) for m in input_messages(req.input)])
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    except (ValueError, ValidationError) as error:
        raise APIError(400, f"input: {quoted(error.errors()) if isinstance(error, ValidationError) else error}",
                       param="input") from None
    instructions = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    await fetch_images(state, new)
    plan = await plan_chat(state, req, instructions + history + new, tools, choice)
    prepared = [await prepare_prompt(state, plan.ids, req.max_output_tokens,
                                     lambda m: req.sampling_params(m, None, structured=plan.structured),
                                     param="input", structured_param=plan.structured_param, lora=lora,
                                     media=plan.media)]
    ctx = _ResponseCall(state, req, plan.shape, history + new)
    outputs = await _run(ctx, req, prepared, request)
    if isinstance(outputs, StreamingResponse):
        return outputs
    return ctx.complete(outputs[0])


async def _tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    """vLLM's ``/tokenize``: a prompt's ids as ``/v1/completions`` makes them, or chat messages' as
    ``/v1/chat/completions`` renders them."""
    if req.model is not None:
        requested_adapter(state, req.model)
    engine = state.engine.engine
    if engine.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send a prompt or messages (one of them)", param="prompt")
    if req.prompt is not None:
        try:
            check_text(req.prompt, "the prompt")
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        ids = list(engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
    else:
        tools, messages = await chat_tools_and_messages(state, req)
        _, ids, _ = await render_conversation(state, messages, tools, add_generation_prompt=req.add_generation_prompt,
                                              continue_final_message=req.continue_final_message,
                                              template_arguments=req.chat_template_kwargs)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    if req.model is not None:
        requested_adapter(state, req.model)
    engine = state.engine.engine
    if engine.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer", param="tokens")
    bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is not a token id of this model (0 to {engine.vocab_size - 1})",
                       param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}


async def _run(ctx: _Call, req, prepared, request: Request) -> StreamingResponse | list[RequestOutput]:
    """Admit the call's prompts, then stream them, or run them to completion and return their outputs."""
    admission = Admission(ctx.state, len(prepared))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(ctx.stream(prepared, admission, include_usage), admission)
    try:
        return await ctx.run_all(prepared, request)
    finally:
        admission.release()


class _Call:
    """One API call: its id and object names, and how its outputs become OpenAI JSON."""

    def __init__(self, state: ServerState, prefix: str, obj: str, n: int, chat: bool, model: str,
                 shape: ChatShape | None = None, echo: bool = False, prompt_logprobs: bool = False):
        self.state, self.obj, self.n, self.chat = state, obj, n, chat
        self.model = model  # the name the request used: the served model's or a LoRA adapter's
        self.shape = shape or ChatShape()  # chat: how outputs become messages (reasoning, tool calls)
        self.echo, self.prompt_logprobs = echo, prompt_logprobs  # completions: what of the prompt is returned
        self._choice_streams: dict[int, ChoiceStream] = {}
        self._echoed: set[int] = set()
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokenizer = state.engine.engine.tokenizer
        self._counts = {"prompt": 0, "completion": 0}  # usage of a streamed call

    async def run_all(self, prepared, request: Request) -> list[RequestOutput]:
        """The outputs of every prompt; the requests are aborted when the client goes away, the timeout passes
        or shutdown's grace period ends first (an APIError says which)."""
        work = asyncio.ensure_future(_all(self.state.engine.generate(p) for p in prepared))
        ended = await wait_or_abort(self.state, work, request_deadline(self.state), client_disconnected(request))
        if ended is not None:
            raise ended
        try:
            outputs = work.result()
        except Exception as error:
            raise engine_error(error) from None
        for output in outputs:
            self.state.metrics.observe(output)
        return outputs

    async def stream(self, prepared, admission: Admission, include_usage: bool) -> AsyncIterator[str]:
        """SSE lines: every prompt's deltas as they come (merged), then usage if asked, then [DONE] — also after
        an error event (a timeout, an engine failure, the end of shutdown's grace period)."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, p, queue)) for i, p in enumerate(prepared)]
        deadline = request_deadline(self.state)
        finals: list[RequestOutput | None] = [None] * len(prepared)
        try:
            for line in self.opening():
                yield line
            pending = len(tasks)
            while pending:
                get = asyncio.ensure_future(queue.get())
                ended = await wait_or_abort(self.state, get, deadline)
                if ended is not None:
                    yield self.error_event(ended)
                    break
                item = get.result()
                if isinstance(item, BaseException):
                    yield self.error_event(engine_error(item))
                    break
                prompt_index, delta = item
                if delta is None:
                    pending -= 1
                    continue
                if delta.finished:
                    finals[prompt_index] = delta
                for o in delta.outputs:
                    for line in self.delta_events(prompt_index, delta, o):
                        yield line
            for line in self.closing(finals if all(f is not None for f in finals) else None, include_usage):
                yield line
        finally:
            for task in tasks:
                task.cancel()  # a disconnect or timeout: each request's stream closes and aborts it
            admission.release()

    def opening(self) -> list[str]:
        """The events a stream starts with: a chat stream's assistant role."""
        if not self.chat:
            return []
        return [_event(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for i in range(self.n)]))]

    def delta_events(self, prompt_index: int, request: RequestOutput, out) -> list[str]:
        return [_event(self.chunk([choice])) for choice in self._delta_choices(prompt_index, request, out)]

    def error_event(self, error: APIError) -> str:
        return _event(error.body())

    def closing(self, finals: list[RequestOutput] | None, include_usage: bool) -> list[str]:
        """The events a stream ends with (``finals``: each prompt's last delta; None when it was cut short)."""
        usage = [_event(self.chunk([], usage=_usage_from_counts(self._counts)))] if include_usage and finals else []
        return usage + ["data: [DONE]\n\n"]

    async def _pump(self, prompt_index: int, prepared: PreparedPrompt, queue: asyncio.Queue) -> None:
        self._counts["prompt"] += len(prepared.prompt_ids)
        full = OutputAccumulator()
        try:
            async for delta in self.state.engine.stream(prepared):
                output = full.add(delta)
                self._counts["completion"] += sum(len(o.token_ids) for o in delta.outputs)
                await queue.put((prompt_index, delta))
            self.state.metrics.observe(output)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the engine failed: tell the client, end its stream
            await queue.put(error)
        finally:
            await queue.put((prompt_index, None))

    def _delta_choices(self, prompt_index: int, request: RequestOutput, out) -> list[dict]:
        """The chunk choices of one completion's delta: a completion's text, or a chat completion's message deltas
        (reasoning, content, tool calls: ``ChoiceStream``), the finish reason on the last."""
        index = prompt_index * self.n + out.index
        if not self.chat:
            return [self.completion_choice(index, request, out, out.logprobs)]
        stream = self._choice_streams.setdefault(index, self.shape.stream())
        deltas = stream.feed(out.text) + (stream.finish() if out.finish_reason else [])
        finish = _finish(out.finish_reason, stream.called)
        if not deltas:
            if not finish and not out.logprobs:
                return []
            deltas = [{}]
        logprobs = self.chat_logprobs(out.logprobs)
        return [{"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                 "finish_reason": finish if i == len(deltas) - 1 else None} for i, delta in enumerate(deltas)]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def body(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def completion_choice(self, index: int, request: RequestOutput, out, logprobs: list | None) -> dict:
        """One completions choice (a stream's delta too): with ``echo`` the prompt's text and logprobs lead the
        first one of each completion; with ``prompt_logprobs`` vLLM's per-token dicts beside it."""
        text, entries, prompt_ids = out.text, logprobs, None
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            prompt_ids = request.prompt_token_ids
            text = (request.prompt if request.prompt is not None else self._decode(prompt_ids)) + text
            if entries is not None:
                entries = (request.prompt_logprobs or [None] * len(prompt_ids)) + list(entries)
        choice = {"index": index, "text": text, "finish_reason": _finish(out.finish_reason),
                  "logprobs": self.completion_logprobs(entries, prompt_ids)}
        if self.prompt_logprobs and request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [self._vllm_logprobs(entry) for entry in request.prompt_logprobs]
        return choice

    def completion_logprobs(self, entries: list[TokenLogprob | None] | None,
                            prompt_ids: Sequence[int] | None = None) -> dict | None:
        """OpenAI's legacy logprobs; an echoed prompt's entries first (``prompt_ids``; the first one's logprob is
        null, as OpenAI's)."""
        if entries is None:
            return None
        ids = list(prompt_ids or []) + [e.token_id for e in entries[len(prompt_ids or []):]]
        tokens = [self._token(t) for t in ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self._token(t): lp for t, lp in e.top.items()}
                                 for e in entries],
                "text_offset": offsets}

    def _vllm_logprobs(self, entry: TokenLogprob | None) -> dict | None:
        """vLLM's ``prompt_logprobs`` entry: token id -> logprob and text, the prompt's token and the top ones."""
        if entry is None:
            return None
        top = {entry.token_id: entry.logprob, **entry.top}
        return {str(t): {"logprob": lp, "decoded_token": self._token(t)} for t, lp in top.items()}

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in e.top.items()]} for e in entries]}


class _ResponseCall(_Call):
    """A ``/v1/responses`` call: its output as Responses items, whole or streamed as the Responses events (each
    with its ``sequence_number``), and the response stored for ``previous_response_id``."""

    def __init__(self, state: ServerState, req: ResponsesRequest, shape: ChatShape, messages: list[dict]):
        super().__init__(state, "resp", "response", 1, chat=True, model=req.model, shape=shape)
        self.req, self.messages = req, messages
        self.items, self.choice = OutputItems(), shape.stream()
        self._sequence = 0

    def complete(self, output: RequestOutput) -> dict:
        """The Response of a finished output (stored if asked)."""
        out = output.outputs[0]
        self.items.feed(self.choice.feed(out.text) + self.choice.finish())
        self.items.finish()
        return self._finished(output, len(out.token_ids), out.finish_reason)

    def _finished(self, last: RequestOutput, output_tokens: int, finish_reason: str | None) -> dict:
        """The finished Response (``last``: the output, or a stream's last delta), stored if asked."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        reasoning = "".join(item["content"][0]["text"] for item in self.items.items if item["type"] == "reasoning")
        usage = response_usage(len(last.prompt_token_ids), output_tokens,
                               last.metrics.num_cached_tokens if last.metrics is not None else 0,
                               len(self.tokenizer(reasoning, add_special_tokens=False).input_ids) if reasoning else 0)
        body = self._body("incomplete" if incomplete else "completed", usage, incomplete)
        if self.req.store:
            reply = message_dicts([ChatMessage.model_validate(self.items.message())])  # as the template takes it
            self.state.responses.put(self.id, StoredResponse(body, self.messages + reply))
        return body

    def _body(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        return response_body(self.id, self.created, self.req, self.model, self.items.items, status, usage, incomplete)

    def _events(self, events: list[dict]) -> list[str]:
        lines = []
        for event in events:
            lines.append(f"event: {event['type']}\n" + _event({**event, "sequence_number": self._sequence}))
            self._sequence += 1
        return lines

    def opening(self) -> list[str]:
        body = self._body("in_progress")
        return self._events([{"type": "response.created", "response": body},
                             {"type": "response.in_progress", "response": body}])

    def delta_events(self, prompt_index: int, request: RequestOutput, out) -> list[str]:
        deltas = self.choice.feed(out.text) + (self.choice.finish() if out.finish_reason else [])
        events = self.items.feed(deltas)
        if out.finish_reason:
            events += self.items.finish()
        return self._events(events)

    def error_event(self, error: APIError) -> str:
        return self._events([{"type": "error", "code": error.code, "message": error.message,
                              "param": error.param}])[0]

    def closing(self, finals: list[RequestOutput] | None, include_usage: bool) -> list[str]:
        if finals is None:
            return []
        last = finals[0]
        body = self._finished(last, self._counts["completion"], last.outputs[0].finish_reason if last.outputs else None)
        return self._events([{"type": f"response.{body['status']}", "response": body}])


async def _all(jobs: Iterable[Awaitable]) -> list:
    """``asyncio.gather`` of the jobs that cancels the others when one fails (gather lets them run on)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def _finish(reason: str | None, called: bool = False) -> str | None:
    """OpenAI's finish reason of an output's (``called``: it made tool calls; one cut short is still "length")."""
    if called and reason not in (None, "length"):
        return "tool_calls"
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _usage_from_counts(counts: dict) -> dict:
    return {"prompt_tokens": counts["prompt"], "completion_tokens": counts["completion"],
            "total_tokens": counts["prompt"] + counts["completion"]}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that give their admission back however the response ends — also when the client
    is gone before the first event (the event generator then never starts, so its own ``finally`` never runs)."""

    def __init__(self, lines: AsyncIterator[str], admission: Admission):
        super().__init__(lines, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


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
