"""A request's body read within the server's limits (413 over ``max_body_bytes``, 408 slower than
``read_timeout``), decoded as a JSON object and validated by its endpoint's pydantic model (400 otherwise)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from hfaccel.serve.config import ServerConfig
from hfaccel.serve.errors import APIError, quoted


async def parsed_body(model: type[BaseModel], http_request: Request, config: ServerConfig):
    """The request's body as ``model``, or the APIError saying why it is not one."""
    return _validated(model, await _json_body(http_request, config))


async def _json_body(http_request: Request, config: ServerConfig) -> dict:
    """The request's body as a JSON object."""
    raw = await _limited_body(http_request, config)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8: {error}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as error:  # malformed, or an integer of more digits than Python converts
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    return body


def _validated(model: type[BaseModel], body: dict):
    """``body`` as ``model`` (strict types: the models say so), or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{param}: {first['msg']} (got {quoted(first.get('input'))})", param=param) from None


async def _limited_body(http_request: Request, config: ServerConfig) -> bytes:
    """The request body, refused (413) as soon as it is known to be too large — from ``Content-Length`` before
    reading anything, else once the chunks read so far add up to more — or (408) when it takes longer than
    ``read_timeout`` to arrive. At most the limit plus one chunk is ever held."""
    limit = config.max_body_bytes
    declared = http_request.headers.get("content-length", "").lstrip("0")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(f"of {declared:.30} bytes", limit)
    deadline = time.monotonic() + config.read_timeout
    chunks, size, stream = [], 0, http_request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {config.read_timeout} s ({size} bytes came)",
                code="timeout",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:
            raise APIError(
                499, "the client closed the connection while sending the request", code="client_closed"
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large("over", limit)
        chunks.append(chunk)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body {size} is over the limit of {limit} bytes", code="body_too_large")
