"""The engine's outputs as OpenAI JSON: completions and chat completions whole (choices, logprobs, usage) or as a
stream's server-sent events (``chat.completion.chunk`` / ``text_completion`` chunks, ending with ``[DONE]``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

from hfaccel.engine import CompletionOutput, RequestOutput
from hfaccel.sampling import TokenLogprob
from hfaccel.serve.chat import ChatShape, ChoiceStream
from hfaccel.serve.errors import APIError


class CallShaper:
    """One API call: its id and object names, and how its outputs become OpenAI JSON. A stream is ``opening()``,
    ``delta_events`` of each delta, then ``closing`` (or ``error_event`` and ``closing``)."""

    def __init__(
        self,
        tokenizer,
        prefix: str,
        obj: str,
        n: int,
        chat: bool,
        model: str,
        shape: ChatShape | None = None,
        echo: bool = False,
        prompt_logprobs: bool = False,
    ):
        self.tokenizer, self.obj, self.n, self.chat = tokenizer, obj, n, chat
        self.model = model  # the name the request used: the served model's or a LoRA adapter's
        self.shape = shape or ChatShape()  # chat: how outputs become messages (reasoning, tool calls)
        self.echo, self.prompt_logprobs = echo, prompt_logprobs  # completions: what of the prompt is returned
        self._choice_streams: dict[int, ChoiceStream] = {}
        self._echoed: set[int] = set()
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def answer(self, choices: list[dict], usage: dict) -> dict:
        """The whole answer of a call that is not streamed."""
        return {
            "id": self.id,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def opening(self) -> list[str]:
        """The events a stream starts with: a chat stream's assistant role."""
        if not self.chat:
            return []
        return [
            sse_event(
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(self.n)
                    ]
                )
            )
        ]

    def delta_events(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> list[str]:
        """The events of one completion's delta (``output``: the delta of the prompt it belongs to)."""
        return [sse_event(self._chunk([choice])) for choice in self._delta_choices(prompt_index, output, completion)]

    def error_event(self, error: APIError) -> str:
        return sse_event(error.body())

    def closing(self, finals: list[RequestOutput] | None, include_usage: bool, usage: dict) -> list[str]:
        """The events a stream ends with (``finals``: each prompt's last delta; None when it was cut short;
        ``usage``: the tokens the stream counted)."""
        usage_events = [sse_event(self._chunk([], usage=usage))] if include_usage and finals else []
        return usage_events + ["data: [DONE]\n\n"]

    def completion_choice(
        self, index: int, output: RequestOutput, completion: CompletionOutput, logprobs: list | None
    ) -> dict:
        """One completions choice (a stream's delta too): with ``echo`` the prompt's text and logprobs lead the
        first one of each completion; with ``prompt_logprobs`` vLLM's per-token dicts beside it."""
        text, entries, prompt_ids = completion.text, logprobs, None
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            prompt_ids = output.prompt_token_ids
            text = (output.prompt if output.prompt is not None else self._decode(prompt_ids)) + text
            if entries is not None:
                entries = (output.prompt_logprobs or [None] * len(prompt_ids)) + list(entries)
        choice = {
            "index": index,
            "text": text,
            "finish_reason": finish_reason(completion.finish_reason),
            "logprobs": self._completion_logprobs(entries, prompt_ids),
        }
        if self.prompt_logprobs and output.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [self._vllm_logprobs(entry) for entry in output.prompt_logprobs]
        return choice

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """A chat choice's ``logprobs``: each token's text, logprob and bytes, with its top alternatives."""
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
                for e in entries
            ]
        }

    def _delta_choices(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> list[dict]:
        """The chunk choices of one completion's delta: a completion's text, or a chat completion's message deltas
        (reasoning, content, tool calls: ``ChoiceStream``), the finish reason on the last."""
        index = prompt_index * self.n + completion.index
        if not self.chat:
            return [self.completion_choice(index, output, completion, completion.logprobs)]
        stream = self._choice_streams.setdefault(index, self.shape.stream())
        deltas = stream.feed(completion.text) + (stream.finish() if completion.finish_reason else [])
        finish = finish_reason(completion.finish_reason, stream.called)
        if not deltas:
            if not finish and not completion.logprobs:
                return []
            deltas = [{}]
        logprobs = self.chat_logprobs(completion.logprobs)
        return [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": finish if i == len(deltas) - 1 else None,
            }
            for i, delta in enumerate(deltas)
        ]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def _completion_logprobs(
        self, entries: list[TokenLogprob | None] | None, prompt_ids: Sequence[int] | None = None
    ) -> dict | None:
        """OpenAI's legacy logprobs; an echoed prompt's entries first (``prompt_ids``; the first one's logprob is
        null, as OpenAI's)."""
        if entries is None:
            return None
        ids = list(prompt_ids or []) + [e.token_id for e in entries[len(prompt_ids or []) :]]
        tokens = [self._token(t) for t in ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {self._token(t): lp for t, lp in e.top.items()} for e in entries],
            "text_offset": offsets,
        }

    def _vllm_logprobs(self, entry: TokenLogprob | None) -> dict | None:
        """vLLM's ``prompt_logprobs`` entry: token id -> logprob and text, the prompt's token and the top ones."""
        if entry is None:
            return None
        top = {entry.token_id: entry.logprob, **entry.top}
        return {str(t): {"logprob": lp, "decoded_token": self._token(t)} for t, lp in top.items()}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""


def finish_reason(reason: str | None, called: bool = False) -> str | None:
    """OpenAI's finish reason of an output's (``called``: it made tool calls; one cut short is still "length")."""
    if called and reason not in (None, "length"):
        return "tool_calls"
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's ``usage`` object; ``cached_tokens``: the prompt tokens taken from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(outputs: list[RequestOutput]) -> dict:
    """The ``usage`` of finished outputs: their prompts' tokens (those from the prefix cache) and every
    completion's."""
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
        sum(cached_tokens(o) for o in outputs),
    )


def cached_tokens(output: RequestOutput | None) -> int:
    """How many of the output's prompt tokens came from the prefix cache (0 before it was scheduled)."""
    return 0 if output is None or output.metrics is None else output.metrics.num_cached_tokens


def sse_event(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
