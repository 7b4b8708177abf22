"""A live request read out as a :class:`RequestOutput`: whole (:func:`snapshot`), or what is new since the last read
(:class:`DeltaTracker`: what ``Engine.stream`` and ``AsyncEngine`` send), and the output of a prompt refused
before it became a request (:func:`error_output`)."""

from __future__ import annotations

from hfaccel.engine.outputs import CompletionOutput, RequestOutput
from hfaccel.engine.scheduler import Request, Sequence


def snapshot(request: Request) -> RequestOutput:
    """The request's outputs so far (text held back where a stop string might still begin)."""
    outputs = []
    for seq in sorted(request.seqs, key=lambda s: s.index):
        out = seq.output
        finished = out.finish_reason is not None
        text = seq.detokenizer.stable_text(finished) if seq.detokenizer is not None else ""
        outputs.append(
            CompletionOutput(
                out.index,
                text,
                list(out.token_ids),
                None if out.logprobs is None else list(out.logprobs),
                out.finish_reason,
                out.stop_reason,
            )
        )
    return RequestOutput(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        outputs,
        request.finished,
        request.error,
        request.metrics,
        None if request.prompt_logprobs is None else list(request.prompt_logprobs),
    )


def error_output(prompt, error: Exception) -> RequestOutput:
    """The finished output of a prompt that could not be served: ``error`` says why."""
    return RequestOutput(
        "",
        prompt if isinstance(prompt, str) else None,
        [],
        [CompletionOutput(0, finish_reason="error")],
        finished=True,
        error=str(error),
    )


class DeltaTracker:
    """What is new in one request since the last call: new text and tokens per completion (read from the
    live request, so the cost follows the new tokens, not the output's length)."""

    def __init__(self):
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.prompt_sent = False

    def delta(self, request: Request) -> RequestOutput | None:
        outputs = [
            delta
            for seq in sorted(request.seqs, key=lambda s: s.index)
            if (delta := self._completion_delta(seq)) is not None
        ]
        prompt = self._prompt_logprobs(request)
        if not outputs and not request.finished and prompt is None:
            return None
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            request.finished,
            request.error,
            request.metrics,
            prompt,
        )

    def _prompt_logprobs(self, request: Request) -> list | None:
        """The request's prompt logprobs the first time they are all known (the first token's is always None)."""
        known = request.prompt_logprobs
        if self.prompt_sent or known is None or any(entry is None for entry in known[1:]):
            return None
        self.prompt_sent = True
        return list(known)

    def _completion_delta(self, seq: Sequence) -> CompletionOutput | None:
        out = seq.output
        if out.index in self.done:
            return None
        finished = out.finish_reason is not None
        detokenizer = seq.detokenizer
        end = detokenizer.stable_length(finished) if detokenizer is not None else 0
        text_at, token_at = self.text.get(out.index, 0), self.tokens.get(out.index, 0)
        if end == text_at and len(out.token_ids) == token_at and not finished:
            return None
        text = detokenizer.text[text_at:end] if detokenizer is not None else ""
        delta = CompletionOutput(
            out.index,
            text,
            out.token_ids[token_at:],
            None if out.logprobs is None else out.logprobs[token_at:],
            out.finish_reason,
            out.stop_reason,
        )
        self.text[out.index], self.tokens[out.index] = end, len(out.token_ids)
        if finished:
            self.done.add(out.index)
        return delta
