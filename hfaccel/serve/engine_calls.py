"""A call's prompts through the engine: admitted, then run to completion or streamed as server-sent events, each
request aborted when its deadline, the end of shutdown's grace period or its client's leaving comes first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from hfaccel.engine import PreparedPrompt, RequestOutput
from hfaccel.engine.async_engine import OutputAccumulator
from hfaccel.serve.admission import Admission, client_disconnected, request_deadline, wait_or_abort
from hfaccel.serve.config import ServerState
from hfaccel.serve.errors import engine_error
from hfaccel.serve.protocol import SamplingRequest
from hfaccel.serve.shaping import CallShaper, cached_tokens, usage


async def run_call(
    state: ServerState, shaper: CallShaper, body: SamplingRequest, prompts: list[PreparedPrompt], http_request: Request
) -> StreamingResponse | list[RequestOutput]:
    """Admit the call's prompts, then stream them (``body.stream``), or run them to completion and return their
    outputs."""
    admission = Admission(state, len(prompts))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_events(state, shaper, prompts, admission, include_usage), admission)
    try:
        return await _outputs(state, prompts, http_request)
    finally:
        admission.release()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that give their admission back however the response ends — also when the client
    is gone before the first event (the event generator then never starts, so its own ``finally`` never runs)."""

    def __init__(self, lines: AsyncIterator[str], admission: Admission):
        super().__init__(
            lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


async def _outputs(state: ServerState, prompts: list[PreparedPrompt], http_request: Request) -> list[RequestOutput]:
    """The outputs of every prompt; the requests are aborted when the client goes away, the timeout passes
    or shutdown's grace period ends first (an APIError says which)."""
    work = asyncio.ensure_future(_gather_or_cancel(state.engine.generate(p) for p in prompts))
    aborted = await wait_or_abort(state, work, request_deadline(state), client_disconnected(http_request))
    if aborted is not None:
        raise aborted
    try:
        outputs = work.result()
    except Exception as error:
        raise engine_error(error) from None
    for output in outputs:
        state.metrics.observe(output)
    return outputs


@dataclass
class _StreamedTokens:
    """The tokens a stream has seen so far: its usage."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0  # prompt tokens from the prefix cache


async def _events(
    state: ServerState, shaper: CallShaper, prompts: list[PreparedPrompt], admission: Admission, include_usage: bool
) -> AsyncIterator[str]:
    """SSE lines: every prompt's deltas as they come (merged), then usage if asked, then [DONE] — also after
    an error event (a timeout, an engine failure, the end of shutdown's grace period)."""
    queue: asyncio.Queue = asyncio.Queue()
    tokens = _StreamedTokens()
    tasks = [asyncio.create_task(_stream_prompt(state, i, p, queue, tokens)) for i, p in enumerate(prompts)]
    deadline = request_deadline(state)
    finals: list[RequestOutput | None] = [None] * len(prompts)
    try:
        for line in shaper.opening():
            yield line
        pending = len(tasks)
        while pending:
            get = asyncio.ensure_future(queue.get())
            aborted = await wait_or_abort(state, get, deadline)
            if aborted is not None:
                yield shaper.error_event(aborted)
                break
            item = get.result()
            if isinstance(item, BaseException):
                yield shaper.error_event(engine_error(item))
                break
            prompt_index, delta = item
            if delta is None:
                pending -= 1
                continue
            if delta.finished:
                finals[prompt_index] = delta
            for completion in delta.outputs:
                for line in shaper.delta_events(prompt_index, delta, completion):
                    yield line
        complete = finals if all(f is not None for f in finals) else None
        for line in shaper.closing(complete, include_usage, usage(tokens.prompt, tokens.completion, tokens.cached)):
            yield line
    finally:
        for task in tasks:
            task.cancel()  # a disconnect or timeout: each request's stream closes and aborts it
        admission.release()


async def _stream_prompt(
    state: ServerState, prompt_index: int, prompt: PreparedPrompt, queue: asyncio.Queue, tokens: _StreamedTokens
) -> None:
    """One prompt's deltas onto ``queue`` as ``(prompt_index, delta)``, an engine failure as the error itself,
    and ``(prompt_index, None)`` last."""
    tokens.prompt += len(prompt.prompt_ids)
    full = OutputAccumulator()
    try:
        async for delta in state.engine.stream(prompt):
            output = full.add(delta)
            tokens.completion += sum(len(c.token_ids) for c in delta.outputs)
            if delta.finished:
                tokens.cached += cached_tokens(output)
            await queue.put((prompt_index, delta))
        state.metrics.observe(output)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the engine failed: tell the client, end its stream
        await queue.put(error)
    finally:
        await queue.put((prompt_index, None))


async def _gather_or_cancel(jobs: Iterable[Awaitable]) -> list:
    """``asyncio.gather`` of the jobs that cancels the others when one fails (gather lets them run on)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
