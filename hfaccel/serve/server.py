"""``hfaccel serve``: an OpenAI-compatible HTTP service over :class:`AsyncEngine` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as server-sent
events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text format, from a registry of this app's own).

Every failure is an OpenAI-style JSON error (``{"error": {"message", "type", "param", "code"}}``): malformed
JSON or UTF-8 and wrongly typed or out-of-range fields → 400, a missing or wrong bearer token → 401, an
unknown model → 404, a body over the size limit → 413, more requests in flight than ``max_queue`` → 429 at
once, a request over ``request_timeout`` → 408 (or, mid-stream, an error event) with the request aborted. A
client that disconnects mid-stream cancels its response task, which aborts its request and frees its KV
blocks. One bad request never affects the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from hfaccel.engine import AsyncEngine, RequestOutput
from hfaccel.engine.async_engine import OutputAccumulator
from hfaccel.sampling import SamplingParams, TokenLogprob
from hfaccel.serve.protocol import ChatCompletionRequest, CompletionRequest, message_dicts

MAX_BODY_BYTES = 8 << 20
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class APIError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Metrics:
    """Prometheus metrics of one server, in a registry of its own (nothing process-global)."""

    def __init__(self, engine: AsyncEngine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hfaccel_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("hfaccel_prompt_tokens", "prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("hfaccel_generation_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("hfaccel_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("hfaccel_inter_token_latency_seconds", "time between tokens of a completion",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("hfaccel_request_latency_seconds", "request arrival to finish",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        gauges = {"hfaccel_queue_depth": ("requests waiting for a slot", lambda s: s["waiting"] + s["queued"]),
                  "hfaccel_running_sequences": ("sequences being decoded", lambda s: s["running"]),
                  "hfaccel_kv_blocks_used": ("KV cache blocks in use", lambda s: s["blocks_used"]),
                  "hfaccel_kv_blocks_free": ("KV cache blocks free", lambda s: s["blocks_free"])}
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(lambda read=read: read(engine.stats()))

    def observe(self, output: RequestOutput) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.finished_time is not None:
            self.latency.observe(metrics.finished_time - metrics.arrival_time)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # requests (prompts) in flight at most; more get 429
    request_timeout: float | None = None  # seconds; None: no limit
    max_body_bytes: int = MAX_BODY_BYTES


@dataclass
class _State:
    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine`` (shut down with the app)."""
    state = _State(engine, config, Metrics(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, True)

    app = FastAPI(title="hfaccel", lifespan=lifespan)
    app.state.hfaccel = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.middleware("http")
    async def count_and_authorize(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1/") and config.api_key is not None and \
                request.headers.get("authorization") != f"Bearer {config.api_key}":
            response = APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                "authentication_error", code="invalid_api_key").response()
        else:
            response = await call_next(request)
        if path.startswith("/v1/"):
            endpoint = path if path in ROUTES else "other"  # a fixed label set, whatever clients send
            state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unavailable", **engine.stats()}, status_code=503)
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hfaccel"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(CompletionRequest, await _json_body(request, config))
        return await _completions(state, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _parse(ChatCompletionRequest, await _json_body(request, config))
        return await _chat(state, body)

    return app


# ----------------------------------------------------------------------------------------- request checks
async def _json_body(request: Request, config: ServerConfig) -> dict:
    raw = await request.body()
    if len(raw) > config.max_body_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes is over the limit of {config.max_body_bytes}")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8: {error}") from None
    except json.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    return body


def _parse(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{param}: {first['msg']} (got {first.get('input')!r:.200})", param=param) from None


def _check_model(state: _State, name: str) -> None:
    if name != state.config.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.config.model_name!r}",
                       code="model_not_found", param="model")


def _prepare(state: _State, prompt, max_tokens: int | None, params_for) -> tuple[list[int], SamplingParams]:
    """Token ids and sampling parameters of one prompt, or a 400 saying what is wrong."""
    engine = state.engine.engine
    try:
        _, ids = engine.prepare_prompt(prompt, SamplingParams())
    except ValueError as error:
        code = "context_length_exceeded" if "context" in str(error) else None
        raise APIError(400, str(error), param="prompt", code=code) from None
    room = engine.max_model_len - len(ids)
    max_tokens = room if max_tokens is None else max_tokens
    if max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
                            f"context is {engine.max_model_len}", param="max_tokens",
                       code="context_length_exceeded")
    try:
        return ids, params_for(max_tokens)
    except ValueError as error:
        raise APIError(400, str(error)) from None


class _Admission:
    """Counts prompts in flight; beyond the limit a request is refused with 429 before any work."""

    def __init__(self, state: _State, count: int):
        if state.in_flight + count > state.config.max_queue:
            raise APIError(429, f"the server is at capacity ({state.in_flight} requests in flight, limit "
                                f"{state.config.max_queue}); retry later", "rate_limit_error",
                           code="overloaded", headers={"Retry-After": "1"})
        self.state, self.count = state, count
        state.in_flight += count

    def release(self) -> None:
        if self.count:
            self.state.in_flight -= self.count
            self.count = 0


# -------------------------------------------------------------------------------------------- handlers
async def _completions(state: _State, req: CompletionRequest):
    _check_model(state, req.model)
    if req.echo or req.suffix:
        raise APIError(400, "echo and suffix are not supported", param="echo" if req.echo else "suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
    prompts = _prompt_list(req.prompt)
    prepared = [_prepare(state, p, req.max_tokens, lambda m: req.sampling_params(m, req.logprobs))
                for p in prompts]
    ctx = _Call(state, "cmpl", "text_completion", req.n, chat=False)
    outputs = await _run(ctx, req, prepared)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = [{"index": i * req.n + o.index, "text": o.text, "finish_reason": _finish(o.finish_reason),
                "logprobs": ctx.completion_logprobs(o.logprobs)} for i, out in enumerate(outputs) for o in out.outputs]
    return ctx.body(choices, _usage(outputs))


async def _chat(state: _State, req: ChatCompletionRequest):
    _check_model(state, req.model)
    if req.tools:
        raise APIError(400, "tools (function calling) are not supported", param="tools")
    try:
        messages = message_dicts(req.messages)
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    prepared = [_prepare(state, messages, max_tokens, lambda m: req.sampling_params(m, logprobs))]
    ctx = _Call(state, "chatcmpl", "chat.completion", req.n, chat=True)
    outputs = await _run(ctx, req, prepared)
    if isinstance(outputs, StreamingResponse):
        return outputs
    choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                "finish_reason": _finish(o.finish_reason), "logprobs": ctx.chat_logprobs(o.logprobs)}
               for o in outputs[0].outputs]
    return ctx.body(choices, _usage(outputs))


async def _run(ctx: _Call, req, prepared) -> StreamingResponse | list[RequestOutput]:
    """Admit the call's prompts, then stream them, or run them to completion and return their outputs."""
    admission = _Admission(ctx.state, len(prepared))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(ctx.stream(prepared, admission, include_usage), admission)
    try:
        return await ctx.run_all(prepared)
    finally:
        admission.release()


class _Call:
    """One API call: its id and object names, and how its outputs become OpenAI JSON."""

    def __init__(self, state: _State, prefix: str, obj: str, n: int, chat: bool):
        self.state, self.obj, self.n, self.chat = state, obj, n, chat
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokenizer = state.engine.engine.tokenizer
        self._counts = {"prompt": 0, "completion": 0}  # usage of a streamed call

    async def run_all(self, prepared) -> list[RequestOutput]:
        timeout = self.state.config.request_timeout
        jobs = asyncio.gather(*(self.state.engine.generate(ids, params) for ids, params in prepared))
        try:
            outputs = await asyncio.wait_for(jobs, timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request took longer than the server's limit of {timeout} s and was "
                                f"aborted", "timeout_error", code="timeout") from None
        except Exception as error:  # the engine failed (e.g. out of memory) or is shutting down
            raise APIError(503, f"the engine could not serve the request: {error}", "server_error") from None
        for output in outputs:
            self.state.metrics.observe(output)
        return outputs

    async def stream(self, prepared, admission: _Admission, include_usage: bool) -> AsyncIterator[str]:
        """SSE lines: every prompt's deltas as they come (merged), then usage if asked, then [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, ids, params, queue)) for i, (ids, params) in enumerate(prepared)]
        deadline = None if self.state.config.request_timeout is None else \
            time.monotonic() + self.state.config.request_timeout
        finals: list[RequestOutput | None] = [None] * len(prepared)
        try:
            if self.chat:
                yield _event(self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for i in range(self.n)]))
            pending = len(tasks)
            while pending:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = await asyncio.wait_for(queue.get(), remaining)
                except asyncio.TimeoutError:
                    yield _event({"error": {"message": "the request took longer than the server's limit and was "
                                            "aborted", "type": "timeout_error", "param": None, "code": "timeout"}})
                    break
                if isinstance(item, BaseException):
                    yield _event({"error": {"message": str(item), "type": "server_error", "param": None,
                                            "code": None}})
                    break
                prompt_index, delta = item
                if delta is None:
                    pending -= 1
                    continue
                if delta.finished:
                    finals[prompt_index] = delta
                choices = [self._delta_choice(prompt_index, o) for o in delta.outputs]
                if choices:
                    yield _event(self.chunk(choices))
            if include_usage and all(f is not None for f in finals):
                yield _event(self.chunk([], usage=_usage_from_counts(self._counts)))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()  # a disconnect or timeout: each request's stream closes and aborts it
            admission.release()

    async def _pump(self, prompt_index: int, ids, params, queue: asyncio.Queue) -> None:
        self._counts["prompt"] += len(ids)
        full = OutputAccumulator()
        try:
            async for delta in self.state.engine.stream(ids, params):
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

    def _delta_choice(self, prompt_index: int, out) -> dict:
        index = prompt_index * self.n + out.index
        finish = _finish(out.finish_reason)
        if self.chat:
            delta = {"content": out.text} if out.text or not finish else {}
            return {"index": index, "delta": delta, "logprobs": self.chat_logprobs(out.logprobs),
                    "finish_reason": finish}
        return {"index": index, "text": out.text, "logprobs": self.completion_logprobs(out.logprobs),
                "finish_reason": finish}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.state.config.model_name,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def body(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.state.config.model_name,
                "choices": choices, "usage": usage}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def completion_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        tokens = [self._token(e.token_id) for e in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top.items()} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in e.top.items()]} for e in entries]}


def _prompt_list(prompt) -> list:
    """A completions ``prompt`` field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(prompt)


def _finish(reason: str | None) -> str | None:
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

    def __init__(self, lines: AsyncIterator[str], admission: _Admission):
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
    """Run the server until SIGINT / SIGTERM: new connections stop, in-flight requests get
    ``graceful_shutdown_s`` to finish, the rest are cancelled (aborted), then the engine stops."""
    import signal

    import uvicorn

    app = create_app(engine, config)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the previous handler: make that
    # an exit with status 0, so process supervisors see a clean stop
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
