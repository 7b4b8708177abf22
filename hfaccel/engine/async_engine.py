"""``AsyncEngine``: the engine stepped by a background thread, for asyncio services.

The thread owns the :class:`Engine`: requests and aborts from the event loop are queued to it and applied
before the next step, so the model never runs concurrently with a change to the queues. Each request's
outputs travel back through its own ``asyncio.Queue``. A consumer that stops iterating (a client that went
away, a cancelled task) aborts its request, which frees its KV blocks at the next step.

LoRA adapters are added and removed in the thread too (:meth:`AsyncEngine.add_lora` reads and checks the files in a
worker thread first), between steps.

A request the engine fails alone (its part of a step raised) raises :class:`RequestFailed` in its stream; a
step that fails as a whole (out of memory) raises its error in the streams of the requests it ran; those
still waiting go on. Either way the thread goes on serving — but not past an error that is no ``Exception``
(``DeviceLostError``: the device keeps an error, nothing more runs on it; ``TensorParallelError``: the TP ranks
diverged), which ends it: every stream gets a RuntimeError naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hfaccel.engine.deltas import DeltaTracker
from hfaccel.engine.engine import Engine
from hfaccel.engine.inputs import PreparedPrompt, Prompt
from hfaccel.engine.outputs import RequestFailed, RequestOutput
from hfaccel.engine.scheduler import Request
from hfaccel.sampling import SamplingParams


@dataclass
class _Pending:
    request_id: str
    prepared: PreparedPrompt
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    """Runs an :class:`Engine` in a background thread; ``stream`` and ``generate`` are coroutines."""

    def __init__(self, engine: Engine, *, on_failure: Callable[[BaseException], None] | None = None):
        """``on_failure``: called in the engine thread with what ended it (never on a shutdown), after every request
        in flight has been failed with it — e.g. a tensor-parallel leader ends its process, so that its launcher
        stops the other ranks, which would wait for its next step forever."""
        self.engine = engine
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[_Pending] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], object], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._calls_closed = False  # the engine thread has stopped taking calls (set under the lock)
        self._streams: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._abort_all = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hfaccel-engine", daemon=True)
        self._thread.start()

    async def prepare(
        self, prompt: Prompt, params: SamplingParams | None = None, *, lora: str | None = None
    ) -> PreparedPrompt:
        """The request checked and tokenized (:meth:`Engine.prepare_prompt`) in a worker thread, so that a long
        prompt never stalls the event loop's other streams; a bad one (an unknown LoRA adapter ``lora`` included)
        raises ValueError."""
        return await asyncio.to_thread(self.engine.prepare_prompt, prompt, params or SamplingParams(), lora=lora)

    async def stream(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's new text and tokens as they come; the last output has ``finished=True``.

        A bad prompt or parameter raises ValueError before anything is yielded; a request the engine failed
        raises :class:`RequestFailed`. A :class:`PreparedPrompt` (from :meth:`prepare`) carries its parameters and
        its LoRA adapter and is not checked again; ``lora``: the LoRA adapter of a prompt given as such.
        """
        if isinstance(prompt, PreparedPrompt):
            prompt.check_call(params, lora)
            prepared = prompt
        else:
            prepared = await self.prepare(prompt, params, lora=lora)
        pending = self._submit(prepared, request_id)
        finished = False
        try:
            while not finished:
                item = await pending.queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, BaseException):  # what ended the engine thread (TensorParallelError): not ours
                    raise RuntimeError(f"the engine thread failed: {item!r}") from item
                if item.error is not None:
                    raise RequestFailed(item.error)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(pending.request_id)

    async def generate(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora: str | None = None,
    ) -> RequestOutput:
        """The request's final output (text and tokens of every completion)."""
        tracker, last = OutputAccumulator(), None
        async for delta in self.stream(prompt, params, request_id, lora=lora):
            last = tracker.add(delta)
        return last

    async def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT LoRA adapter at ``path`` as ``name`` (:meth:`Engine.add_lora`): read and checked in a worker
        thread, registered between two steps. A bad adapter raises ValueError and changes nothing."""
        manager = self.engine._lora_manager("add_lora")
        adapter = await asyncio.to_thread(manager.load, name, path)
        await self._in_thread(lambda: manager.register(adapter))

    async def remove_lora(self, name: str) -> None:
        """Stop serving the adapter ``name`` between two steps (:meth:`Engine.remove_lora`: refused while
        unfinished requests use it)."""
        await self._in_thread(lambda: self.engine.remove_lora(name))

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it has finished)."""
        with self._lock:
            self._aborts.append(str(request_id))
        self._wake.set()

    def stats(self) -> dict[str, int]:
        with self._lock:
            queued = len(self._adds)
        return {**self.engine.stats(), "queued": queued}

    @property
    def healthy(self) -> bool:
        """Whether the engine thread is running (False after a fatal error or shutdown)."""
        return self._thread.is_alive() and self._error is None and not self._stopping

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the thread: abort what is in flight (or let it finish first with ``abort=False``)."""
        self._abort_all = abort
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---------------------------------------------------------------------------------------- internals
    def _submit(self, prepared: PreparedPrompt, request_id: str | None) -> _Pending:
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        if self._error is not None:
            raise RuntimeError(f"the engine thread failed: {self._error!r}") from self._error
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        pending = _Pending(request_id, prepared, asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            self._adds.append(pending)
        self._wake.set()
        return pending

    async def _in_thread(self, call: Callable[[], object]):
        """``call()`` run by the engine thread between two steps; its result or its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:  # checked and queued at once: the thread's last drain cannot slip in between
            if self._stopping or self._error is not None or self._calls_closed:
                raise RuntimeError(
                    "the engine is shutting down"
                    if self._stopping or self._error is None
                    else f"the engine thread failed: {self._error!r}"
                )
            self._calls.append((call, future, loop))
        self._wake.set()
        return await future

    def _run(self) -> None:
        trackers: dict[str, DeltaTracker] = {}
        try:
            while True:
                self._apply_queued(trackers)
                if self._stopping and self._abort_all:
                    self._fail_in_flight(RuntimeError("the engine is shutting down"), trackers)
                if self._stopping and not self.engine.has_unfinished_requests():
                    break
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    changed = self.engine.step_requests()
                except Exception as error:  # e.g. out of memory: fail the step's requests, keep serving
                    self._fail_in_flight(error, trackers, running_only=True)
                    continue
                for request in changed:
                    self._deliver(request, trackers)
        except BaseException as error:  # the thread itself is going down: nobody may wait forever
            self._error = error
            with contextlib.suppress(Exception):  # its streams told first; a lost device fails the aborts too
                self._fail_in_flight(error, trackers)
            with self._lock:
                adds, self._adds = self._adds, []
            for pending in adds:
                _send(pending, error)
            if self._on_failure is not None:
                self._on_failure(error)
        finally:
            with self._lock:
                calls, self._calls = self._calls, []
                self._calls_closed = True
            for _, future, loop in calls:  # queued after the last pass: they never ran
                _resolve(future, loop, exception=RuntimeError("the engine thread stopped"))

    def _fail_in_flight(
        self, error: BaseException, trackers: dict[str, DeltaTracker], running_only: bool = False
    ) -> None:
        """Abort every request in flight (``running_only``: those the failed step ran — the requests with a
        running sequence — or all if none has); each stream gets ``error`` first, so that an abort that raises leaves
        no stream waiting."""
        failing = list(self._streams.items())
        if running_only:
            running = {seq.request.request_id for seq in self.engine.scheduler.running}
            failing = [(request_id, pending) for request_id, pending in failing if request_id in running] or failing
        for request_id, pending in failing:
            _send(pending, error)
            del self._streams[request_id]
            trackers.pop(request_id, None)
        for request_id, _ in failing:
            self.engine.abort(request_id)
            self.engine.release(request_id)

    def _apply_queued(self, trackers: dict[str, DeltaTracker]) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        held = [request_id for request_id in aborts if request_id in self.engine.requests]
        self._abort(held, trackers)  # first: a call queued after an abort (remove_lora) sees it done
        for call, future, loop in calls:  # before the adds: a request may name an adapter just added
            _settle(call, future, loop)
        for pending in adds:
            try:
                self.engine.add_request(pending.prepared, request_id=pending.request_id)
            except Exception as error:  # a bad request fails alone, whatever raised
                _send(pending, error)
                continue
            self._streams[pending.request_id] = pending
            trackers[pending.request_id] = DeltaTracker()
        self._abort([request_id for request_id in aborts if request_id not in held], trackers)

    def _abort(self, request_ids: list[str], trackers: dict[str, DeltaTracker]) -> None:
        for request_id in request_ids:
            if self.engine.abort(request_id):
                self._deliver(self.engine.requests[request_id], trackers)

    def _deliver(self, request: Request, trackers: dict[str, DeltaTracker]) -> None:
        pending = self._streams.get(request.request_id)
        if pending is None:
            return
        delta = trackers[request.request_id].delta(request)
        if delta is not None and not _send(pending, delta):
            self.engine.abort(request.request_id)  # its event loop is gone: nobody will read it
        if request.finished:
            del self._streams[request.request_id]
            del trackers[request.request_id]
            self.engine.release(request.request_id)


def _settle(call: Callable[[], object], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    """Run a queued call in the engine thread and hand its outcome to the caller's event loop."""
    try:
        result = call()
    except Exception as error:
        _resolve(future, loop, exception=error)
    else:
        _resolve(future, loop, result=result)


def _resolve(
    future: asyncio.Future, loop: asyncio.AbstractEventLoop, *, result=None, exception: BaseException | None = None
) -> None:
    def settle() -> None:
        if not future.done():
            future.set_exception(exception) if exception is not None else future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody waits
        pass


def _send(pending: _Pending, item) -> bool:
    """Hand an item to the stream's event loop; False if that loop is closed."""
    try:
        pending.loop.call_soon_threadsafe(pending.queue.put_nowait, item)
    except RuntimeError:
        return False
    return True


class OutputAccumulator:
    """Joins stream deltas back into the request's full output."""

    def __init__(self):
        self.full: RequestOutput | None = None

    def add(self, delta: RequestOutput) -> RequestOutput:
        if self.full is None:
            self.full = RequestOutput(
                delta.request_id, delta.prompt, delta.prompt_token_ids, [], delta.finished, delta.error, delta.metrics
            )
        by_index = {out.index: out for out in self.full.outputs}
        for out in delta.outputs:
            if out.index not in by_index:
                by_index[out.index] = type(out)(out.index, logprobs=None if out.logprobs is None else [])
                self.full.outputs.append(by_index[out.index])
            target = by_index[out.index]
            target.text += out.text
            target.token_ids += out.token_ids
            if out.logprobs is not None:
                target.logprobs = (target.logprobs or []) + out.logprobs
            target.finish_reason, target.stop_reason = out.finish_reason, out.stop_reason
        self.full.outputs.sort(key=lambda out: out.index)
        self.full.finished, self.full.error, self.full.metrics = delta.finished, delta.error, delta.metrics
        if delta.prompt_logprobs is not None:  # sent once, in one delta
            self.full.prompt_logprobs = delta.prompt_logprobs
        return self.full
