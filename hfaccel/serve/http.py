"""The HTTP server under ``hfaccel serve``'s app: uvicorn, with the two things it lacks.

- **A deadline for request headers.** uvicorn times out idle keep-alive connections, but every byte received
  resets that timer and nothing bounds how long a request's headers may take, so a client trickling a request
  line byte by byte (slowloris) holds its connection forever. :func:`h11_with_header_deadline` gives uvicorn's
  h11 protocol a deadline for each request's headers, counted from the connection's start or the previous
  response's end; the same clock bounds a body that is still arriving after the app answered without reading
  it (a 413). The app bounds the time to read a body itself (a 408).
- **A shutdown the app hears about first.** On SIGTERM uvicorn stops accepting connections, waits for the
  requests in flight, cancels those still running when its timeout ends, and only then tells the app (the
  lifespan). :class:`DrainingServer` calls the app's ``on_shutdown`` as shutdown begins, so the app can end
  each request cleanly itself (a final error event for a stream, a JSON 503 otherwise) before that. Once it
  listens, it prints the address it bound (:data:`LISTENING`): ``--port 0`` lets the system pick a free port,
  and whoever started the server reads it back (:func:`wait_until_serving`).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

LISTENING = "hfaccel serve: listening on "  # + the URL, one line on stdout once the socket is bound


class _HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol; a connection whose next request's headers have not all arrived within
    ``header_timeout`` seconds is closed."""

    header_timeout: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived: the app runs, it bounds the body's time
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # first: a pipelined request that the call below starts disarms it
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request in %s s", self.header_timeout)
            self.transport.close()


def h11_with_header_deadline(header_timeout: float) -> type[H11Protocol]:
    """A uvicorn ``http`` protocol class: h11 with a deadline of ``header_timeout`` seconds for headers."""
    return type("H11WithHeaderDeadline", (_HeaderDeadlineH11,), {"header_timeout": header_timeout})


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that calls ``on_shutdown()`` (in the event loop) as its graceful shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"{LISTENING}http://{f'[{host}]' if ':' in host else host}:{port}", flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)


def listening_url(output: str) -> str | None:
    """The URL a ``hfaccel serve`` process listens on, read from its ``output``; None before it listens."""
    match = re.search(re.escape(LISTENING) + r"(\S+)", output)
    return match.group(1) if match else None


def wait_until_serving(process: subprocess.Popen, output: Path, timeout: float) -> str:
    """The base URL of the ``hfaccel serve`` ``process`` (whose output goes to the file ``output``: ``--port 0``
    prints the port it took) once it answers ``/health``; a RuntimeError with the end of its output when it exits or
    ``timeout`` seconds pass first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hfaccel serve exited with status {process.returncode}:\n{output.read_text()[-4000:]}")
        url = listening_url(output.read_text())
        try:
            if url is not None and httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"hfaccel serve did not answer in {timeout:.0f} s:\n{output.read_text()[-4000:]}")
