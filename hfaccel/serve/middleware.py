"""The app's ASGI middleware: a request id on every answer, and the API key checked and every answer counted on
``/v1/*``. Pure ASGI (no ``BaseHTTPMiddleware``): the request body and disconnects reach the app as they come."""

from __future__ import annotations

import secrets
import uuid

from starlette.datastructures import Headers

from hfaccel.serve.config import ServerState
from hfaccel.serve.errors import APIError

COUNTED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models")


class RequestIdMiddleware:
    """Every HTTP answer carries an ``X-Request-Id`` header — the request's own, or a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if 0 < len(given) <= 200 and given.isprintable() and given.isascii() else uuid.uuid4().hex

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        await self.app(scope, receive, tagged)


class AuthorizeAndCountMiddleware:
    """For ``/v1/*``: the bearer token checked before anything else runs (401), and every answer counted by
    endpoint and status."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, counted)
            else:
                error = APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
                await error.response()(scope, receive, counted)
        finally:
            endpoint = path if path in COUNTED_ROUTES else "other"  # a fixed label set, whatever clients send
            self.state.metrics.requests.labels(endpoint, str(status)).inc()

    def _authorized(self, scope) -> bool:
        key = self.state.config.api_key
        if key is None:
            return True
        given = Headers(scope=scope).get("authorization", "").encode("utf-8", "replace")
        return secrets.compare_digest(given, f"Bearer {key}".encode())
