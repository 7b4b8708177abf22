"""What an engine request gets back: ``RequestOutput`` (its ``CompletionOutput`` s) and ``RequestMetrics``."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfaccel.sampling import TokenLogprob


class RequestFailed(RuntimeError):
    """A request the engine failed alone (its part of a step raised); the other requests went on."""


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request, as far as it got."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: the full outputs so far, or (from ``stream``) just what is new since the last one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # why it could not be served, or why it failed (its finish_reason is "error")
    metrics: RequestMetrics | None = None
    # each prompt token's logprob given those before it (the first None), when the request asked for them: in a
    # snapshot once known; in a stream, in the first delta after they all are
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestMetrics:
    """Timing of a request (``time.perf_counter`` seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each new token (of completion 0) came out
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
