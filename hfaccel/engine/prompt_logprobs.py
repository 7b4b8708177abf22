"""Prompt logprobs: each prompt token's log-probability given the tokens before it (``SamplingParams.prompt_logprobs``,
what ``/v1/completions`` with ``echo`` returns and lm-evaluation-harness scores multiple-choice tasks by).

They come from the forwards that compute the prompt anyway: a chunk of a prompt that asks for them has the logits
of its tokens kept beside the rows the step samples from (``ModelRunner.forward(prompt_rows=...)``), the
log-softmax taken on the device and copied to the host without waiting, and the request's list filled when the step
is collected. Chunked prefill fills it chunk by chunk; such a request never takes prompt blocks from the prefix
cache (the scheduler salts them with its id), so every position is computed once here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfaccel.device import to_device
from hfaccel.engine.scheduler import Request, ScheduledChunk
from hfaccel.sampling import TokenLogprob
from hfaccel.sampling.sampler import SampledTokens, add_logprobs


@dataclass
class PromptRows:
    """The packed rows of one forward whose logits give prompt logprobs: row ``rows[j]`` predicts prompt token
    ``positions[j]`` of ``requests[j]``."""

    rows: list[int]
    requests: list[Request]
    positions: list[int]

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> PromptRows | None:
        """The rows of ``chunks`` (packed in order) that compute prompt logprobs not known yet; None if none."""
        rows, requests, positions, offset = [], [], [], 0
        for chunk in chunks:
            request = chunk.seq.request
            if request.prompt_logprobs is not None:
                last = min(chunk.start + chunk.length, request.num_prompt_tokens - 1)  # the last predicts no prompt
                for position in range(chunk.start, last):
                    if request.prompt_logprobs[position + 1] is None:
                        rows.append(offset + position - chunk.start)
                        requests.append(request)
                        positions.append(position + 1)
            offset += chunk.length
        return cls(rows, requests, positions) if rows else None

    def logprobs(self, logits: torch.Tensor) -> PendingPromptLogprobs:
        """From the logits of :attr:`rows` (``[len(rows), V]``), queued on the device and copying to the host."""
        targets = to_device(
            [r.prompt_token_ids[p] for r, p in zip(self.requests, self.positions)], torch.long, logits.device
        )
        counts = [r.params.prompt_logprobs for r in self.requests]
        result = add_logprobs(SampledTokens(targets), logits, targets, list(range(len(self.rows))), counts)
        return PendingPromptLogprobs(self, result.start_copy())


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs on their way to the host."""

    rows: PromptRows
    result: SampledTokens

    def fill(self) -> None:
        """Put each one in its request's list (waits for the copy)."""
        _, entries = self.result.result()
        for request, position, entry in zip(self.rows.requests, self.rows.positions, entries):
            request.prompt_logprobs[position] = entry


def empty_prompt_logprobs(request: Request) -> list[TokenLogprob | None] | None:
    """A request's prompt logprobs before any is computed (None when it did not ask for them)."""
    return None if request.params.prompt_logprobs is None else [None] * request.num_prompt_tokens
