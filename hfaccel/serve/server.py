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

This module builds the app (routes, middleware, error handlers) and runs it. Beside it: ``endpoints`` (what each
route does), ``prompts`` (a request's prompts checked and prepared), ``engine_calls`` (running them, streamed or
not), ``shaping`` (outputs as OpenAI JSON), ``request_body`` and ``admission`` (the limits), ``middleware``,
``errors``, ``metrics`` and ``config``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from hfaccel.engine import AsyncEngine
from hfaccel.serve import endpoints
from hfaccel.serve.config import ServerConfig, ServerState
from hfaccel.serve.errors import APIError, quoted
from hfaccel.serve.middleware import AuthorizeAndCountMiddleware, RequestIdMiddleware
from hfaccel.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from hfaccel.serve.request_body import parsed_body
from hfaccel.serve.responses import ResponsesRequest

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
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
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
        return PlainTextResponse(
            generate_latest(state.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
        )

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
        return {
            "object": "list",
            "data": [base]
            + [{**base, "id": adapter.name, "root": adapter.path, "parent": config.model_name} for adapter in adapters],
        }

    for path, model, handler in (
        ("/v1/completions", CompletionRequest, endpoints.completions),
        ("/v1/chat/completions", ChatCompletionRequest, endpoints.chat_completions),
        ("/v1/responses", ResponsesRequest, endpoints.responses),
    ):
        app.add_api_route(path, _generating(state, model, handler), methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        record = state.responses.get(response_id)
        if record is None:
            raise APIError(
                404,
                f"no stored response has the id {response_id!r:.80}",
                param="response_id",
                code="response_not_found",
            )
        return record.body

    @app.post("/tokenize")
    async def tokenize(http_request: Request):
        return await endpoints.tokenize(state, await parsed_body(TokenizeRequest, http_request, config))

    @app.post("/detokenize")
    async def detokenize(http_request: Request):
        return endpoints.detokenize(state, await parsed_body(DetokenizeRequest, http_request, config))


def _generating(state: ServerState, model: type[BaseModel], handler):
    """The endpoint of a generating route: its body parsed as ``model``, then ``handler(state, body, http_request)``."""

    async def endpoint(http_request: Request):
        return await handler(state, await parsed_body(model, http_request, state.config), http_request)

    return endpoint


def serve(
    engine: AsyncEngine,
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    graceful_shutdown_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Run the server until SIGINT / SIGTERM: new connections stop and new requests get 503, in-flight requests
    get ``graceful_shutdown_s`` to finish, the rest end cleanly (streams with an error event and ``[DONE]``,
    others with a JSON 503) and are aborted, then the engine stops."""
    import signal

    import uvicorn

    from hfaccel.serve.http import DrainingServer, h11_with_header_deadline

    app = create_app(engine, config)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            http=h11_with_header_deadline(config.read_timeout),
            timeout_graceful_shutdown=graceful_shutdown_s + FINAL_WRITE_S,
        ),
        on_shutdown=lambda: app.state.hfaccel.drain(graceful_shutdown_s),
    )
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the previous handler: make that
    # an exit with status 0, so process supervisors see a clean stop
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server.run()
    if not server.started:
        raise SystemExit(f"hfaccel serve: the server could not start on {host}:{port} (see the log above)")


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
