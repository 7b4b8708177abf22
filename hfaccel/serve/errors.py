"""The server's one error shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status
that carries it."""

from __future__ import annotations

import json
import reprlib

from fastapi.responses import Response

from hfaccel.engine import RequestFailed

ERROR_TYPES = {401: "authentication_error", 408: "timeout_error", 429: "rate_limit_error"}
_QUOTE = reprlib.Repr()  # client input quoted in an error message: bounded in length and depth
_QUOTE.maxstring = _QUOTE.maxother = 200


class APIError(Exception):
    """An error answered in OpenAI's format (type by status unless given)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # json.dumps escapes non-ASCII, so any text (a lone surrogate from a client's JSON) can be sent
        return Response(json.dumps(self.body()), self.status, self.headers, media_type="application/json")


def quoted(value) -> str:
    """``repr`` of client input for an error message, bounded in length and depth."""
    return _QUOTE.repr(value)


def engine_error(error: BaseException) -> APIError:
    """What the client is told when the engine did not serve its request."""
    if isinstance(error, ValueError):  # refused on submission
        return APIError(400, str(error))
    if isinstance(error, RequestFailed):  # the engine failed this request alone
        return APIError(500, str(error))
    # a step failed as a whole (e.g. out of memory), or the engine is stopping
    return APIError(503, f"the engine could not serve the request: {error}")
