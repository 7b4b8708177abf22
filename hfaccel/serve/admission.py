"""Which requests run, and until when: admission by the prompts in flight (429 beyond ``max_queue``, 503 once
shutdown began), and the three ends that abort a running request — its deadline (408), the end of shutdown's grace
period (503) and its client going away (499)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from fastapi import Request

from hfaccel.serve.config import ServerState
from hfaccel.serve.errors import APIError


class Admission:
    """Counts prompts in flight; beyond the limit a request is refused with 429 before any work (400 if it
    could never be admitted, 503 once shutdown began)."""

    def __init__(self, state: ServerState, count: int):
        limit = state.config.max_queue
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if count > limit:
            raise APIError(
                400,
                f"a request of {count} prompts can never be admitted: the server holds at most "
                f"{limit} in flight (--max-queue)",
                param="prompt",
            )
        if state.in_flight + count > limit:
            raise APIError(
                429,
                f"the server is at capacity ({state.in_flight} requests in flight, limit {limit}); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.state, self.count = state, count
        state.in_flight += count

    def release(self) -> None:
        """Give the prompts' places back (once; later calls do nothing)."""
        if self.count:
            self.state.in_flight -= self.count
            self.count = 0


def request_deadline(state: ServerState) -> float | None:
    """The ``time.monotonic`` by which a request starting now must end (None: no limit)."""
    timeout = state.config.request_timeout
    return None if timeout is None else time.monotonic() + timeout


async def wait_or_abort(
    state: ServerState, work: Awaitable, deadline: float | None, client_gone: Awaitable | None = None
) -> APIError | None:
    """Wait for ``work``; None once it is done. If first the deadline (``time.monotonic``) passes (408),
    shutdown's grace period ends (503) or ``client_gone`` returns (499), ``work`` is cancelled — its requests
    are aborted — and that error is returned. ``client_gone`` is cancelled anyway."""
    futures = [asyncio.ensure_future(w) for w in [work] + ([] if client_gone is None else [client_gone])]
    stop = asyncio.ensure_future(state.stopping.wait())
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        done, _ = await asyncio.wait([*futures, stop], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in [*futures[1:], stop]:
            future.cancel()
    if futures[0] in done:
        return None
    futures[0].cancel()
    if stop in done:
        return APIError(503, "the server is shutting down; the request was aborted", code="shutting_down")
    if done:  # 499, nginx's "client closed request": nobody reads it, but /metrics counts it
        return APIError(499, "the client closed the connection; the request was aborted", code="client_closed")
    return APIError(
        408,
        f"the request took longer than the server's limit of {state.config.request_timeout} s and was aborted",
        code="timeout",
    )


async def client_disconnected(http_request: Request) -> None:
    """Returns when the client has closed the connection (call once the body is read)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
