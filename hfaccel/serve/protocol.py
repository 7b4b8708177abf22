"""OpenAI API request bodies (pydantic) and their translation to :class:`SamplingParams`.

Fields OpenAI defines are typed strictly, as OpenAI's API does (``true`` is not a number, ``"yes"`` not a bool):
a wrong type is a 400 with OpenAI's error shape. Values are checked where the Python API's are, by
:class:`SamplingParams` and :meth:`Engine.check_params`; only the limits OpenAI's API sets below the engine's
are checked here (``temperature`` ≤ 2, completions ``logprobs`` ≤ 5). Fields OpenAI does not define are
accepted and ignored, as OpenAI's own server does with new client fields. hfaccel extensions (``top_k``,
``min_p``, ``repetition_penalty``) follow vLLM's names.

Structured outputs: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` field (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) — one of them — becomes
``SamplingParams.structured_outputs``; a malformed one is an :class:`InvalidSamplingParams` naming the field, and a
spec that does not compile is refused by :meth:`Engine.check_params` like any other value.

``max_tokens`` defaults as OpenAI's: 16 for completions (also when given as null), the rest of the context for
chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hfaccel.sampling import InvalidSamplingParams, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    temperature: float = Field(1.0, le=2)  # OpenAI's limit; the engine's rules are SamplingParams'
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    response_format: dict | None = None  # OpenAI's
    structured_outputs: dict | None = None  # vLLM's

    @property
    def structured_field(self) -> str:
        """The request field a structured-outputs error names."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters (``SamplingParams`` checks every value; InvalidSamplingParams names it)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, stop=stop, seed=self.seed, n=self.n,
                              logprobs=logprobs,
                              structured_outputs=structured_spec(self.response_format, self.structured_outputs))


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_MAX_TOKENS
    logprobs: int | None = Field(None, le=5)  # OpenAI's limit for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def max_new_tokens(self) -> int:
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """None: the rest of the context."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the tokenizer's chat template takes them (text parts of a content list joined)."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("only text content parts are supported (no images or audio)")
            content = "".join(str(part.get("text", "")) for part in content)
        out.append({"role": message.role, "content": content or ""})
    return out


def structured_spec(response_format: dict | None, structured_outputs: dict | None) -> dict | None:
    """The ``SamplingParams.structured_outputs`` dict of a request's ``response_format`` (OpenAI's) or
    ``structured_outputs`` (vLLM's, passed on as it is: ``StructuredOutputs.from_dict`` checks it); None: no
    constraint. Both constraining at once: :class:`InvalidSamplingParams`."""
    from_format = response_format_spec(response_format)
    if from_format is not None and structured_outputs is not None:
        raise InvalidSamplingParams("structured_outputs", f"response_format of type {response_format['type']!r} "
                                    f"and structured_outputs both constrain the output; send one of them")
    return from_format if from_format is not None else structured_outputs


def response_format_spec(response_format: dict | None) -> dict | None:
    """OpenAI's ``response_format`` as a ``StructuredOutputs`` dict: ``{"type": "text"}`` (or none) → None,
    ``{"type": "json_object"}`` → any JSON object, ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}`` → that schema (always enforced, whatever ``strict`` says)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": _json_schema(response_format.get("json_schema"))}
    raise _bad_format("type", "'text', 'json_object' or 'json_schema'", kind)


def _json_schema(body: Any) -> dict:
    """The schema of ``response_format.json_schema`` (``name`` a string, ``schema`` an object, ``strict`` a bool)."""
    if not isinstance(body, dict):
        raise _bad_format("json_schema", "an object with name and schema", body)
    if not isinstance(body.get("name"), str) or not body["name"]:
        raise _bad_format("json_schema.name", "a non-empty string", body.get("name"))
    if not isinstance(body.get("schema"), dict):
        raise _bad_format("json_schema.schema", "a JSON schema (an object)", body.get("schema"))
    if not isinstance(body.get("strict"), (bool, type(None))):
        raise _bad_format("json_schema.strict", "a boolean", body["strict"])
    return body["schema"]


def _bad_format(field: str, expected: str, given: Any) -> InvalidSamplingParams:
    shown = "nothing" if given is None else f"{type(given).__name__} {given!r:.80}"
    return InvalidSamplingParams("response_format", f"response_format.{field} must be {expected}; got {shown}")
