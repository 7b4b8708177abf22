"""The engine driven to completion by its caller: ``generate`` (prompts run to their ends) and ``stream`` (one
request's deltas after each step). ``AsyncEngine`` drives the same steps from a thread for services."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from hfaccel.engine.deltas import DeltaTracker, error_output
from hfaccel.engine.inputs import Prompt, per_prompt
from hfaccel.engine.outputs import RequestOutput
from hfaccel.engine.scheduler import Request
from hfaccel.sampling import SamplingParams


class BlockingCalls:
    """A part of :class:`~hfaccel.engine.Engine`: calls that run its steps until their requests end."""

    requests: dict[str, Request]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order.

        A prompt that cannot be served (empty, too long, bad token ids, parameters beyond the model), or whose
        part of a step fails, gets an output with ``error`` set and ``finish_reason="error"``; the others run
        normally. A step that fails as a whole (out of memory) raises, with this call's requests taken out.
        ``lora``: one LoRA adapter name for every prompt, or one per prompt (None: the base model); a name the
        engine does not serve raises ValueError before anything runs.
        """
        batch = per_prompt(prompts, params, lora)
        for name in {name for _, _, name in batch}:
            self.lora_adapter(name)  # an unknown name: nothing admitted
        ids: list[str | RequestOutput] = []
        with self._taken_out(ids):
            for prompt, param, name in batch:
                try:
                    ids.append(self.add_request(prompt, param, lora=name))
                except ValueError as error:
                    ids.append(error_output(prompt, error))
            while self.has_unfinished_requests():
                self.step_requests()
            return [self.snapshot(self.requests[i]) if isinstance(i, str) else i for i in ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, lora: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield what is new for this request after each step (other queued requests advance too).

        Each yielded output holds only the new text and token ids of each completion; the last one has
        ``finished=True``. Closing the iterator early aborts the request. ``lora``: its LoRA adapter's name.
        """
        request_id = self.add_request(prompt, params, lora=lora)
        seen = DeltaTracker()
        with self._taken_out([request_id]):
            while True:
                request = self.requests[request_id]
                if not request.finished:
                    self.step_requests()
                delta = seen.delta(request)
                if delta is not None:
                    yield delta
                if request.finished:
                    return

    @contextlib.contextmanager
    def _taken_out(self, ids: list[str | RequestOutput]) -> Iterator[None]:
        """Abort and release the requests of ``ids`` (the ids among them, as they are when the block ends) however the
        block ends (a step that raised included: the engine goes on serving). When the block raised, what it raised
        is what the caller sees, even if the clean-up fails too (a lost device fails the aborts)."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self._take_out(ids)
            raise
        self._take_out(ids)

    def _take_out(self, ids: list[str | RequestOutput]) -> None:
        for request_id in ids:
            if isinstance(request_id, str):
                self.abort(request_id)
                self.release(request_id)
