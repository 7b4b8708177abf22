"""OpenAI API request bodies (pydantic) and their translation to :class:`SamplingParams`.

Fields OpenAI defines are typed strictly, as OpenAI's API does (``true`` is not a number, ``"yes"`` not a bool):
a wrong type is a 400 with OpenAI's error shape. Values are checked where the Python API's are, by
:class:`SamplingParams` and :meth:`Engine.check_params`; only the limits OpenAI's API sets below the engine's
are checked here (``temperature`` ≤ 2, completions ``logprobs`` ≤ 5). Every field that changes the output is
honoured; an OpenAI field this server does not implement is a 400 naming it (:data:`REFUSED`), never silently
ignored; fields OpenAI does not define are accepted and ignored, as OpenAI's own server does with new client fields.
hfaccel extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``chat_template_kwargs``, ...) follow vLLM's names.

Structured outputs: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` field (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) — one of them — becomes
``SamplingParams.structured_outputs``; a malformed one is an :class:`InvalidSamplingParams` naming the field, and a
spec that does not compile is refused by :meth:`Engine.check_params` like any other value.

``max_tokens`` defaults as OpenAI's: 16 for completions (also when given as null), the rest of the context for
chat.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hfaccel.sampling import InvalidSamplingParams, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI fields this server does not implement, with the values that change nothing (a request sending another
# value gets a 400 naming the field): what LangChain, the Agents SDK and instructor send by default passes.
REFUSED: dict[str, tuple] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "suffix": (None, ""),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The sampling fields every generating endpoint shares."""

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
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def refused_field(self, also: tuple[str, ...] = ()) -> str | None:
        """The first OpenAI field of :data:`REFUSED` (or ``also``: fields of this endpoint's API that no value of
        makes sense here) the request sends with a value that would change the output, or None."""
        extra = self.model_extra or {}
        for name, harmless in REFUSED.items():
            if name in extra and extra[name] not in harmless:
                return name
        return next((name for name in also if extra.get(name) is not None), None)

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with token-id keys (OpenAI sends them as strings); an empty one is none."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.lstrip("-").isdigit() or len(key) > 20:
                raise InvalidSamplingParams("logit_bias", f"logit_bias keys must be token ids; got {key!r:.40}")
            bias[int(key)] = value
        return bias

    @property
    def structured_field(self) -> str:
        """The request field a structured-outputs error names."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_request(self) -> dict | None:
        """The request's own constraint (``response_format`` or ``structured_outputs``) as a ``StructuredOutputs``
        dict; None: none."""
        return structured_spec(self.response_format, self.structured_outputs)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        *,
        n: int | None = None,
        structured: dict | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters (``SamplingParams`` checks every value; InvalidSamplingParams names it);
        ``structured``: a constraint of the server's own (tool calls) instead of the request's."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        spec = structured if structured is not None else self.structured_request()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=stop,
            seed=self.seed,
            n=self.n if n is None else n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.token_bias(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=spec,
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_MAX_TOKENS
    logprobs: int | None = Field(None, le=5)  # OpenAI's limit for completions
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's

    @property
    def max_new_tokens(self) -> int:
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to one


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: passed to the chat template (enable_thinking, ...)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def max_new_tokens(self) -> int | None:
        """None: the rest of the context."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a completion prompt, or chat messages rendered as ``/v1/chat/completions`` renders them."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's: as /v1/completions tokenizes it
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the tokenizer's chat template takes them: text parts of a content list joined, an
    assistant's ``tool_calls`` with their arguments as objects (what chat templates render), a tool message's
    ``tool_call_id`` and ``name``. A malformed message is a ValueError naming its field."""
    return [_message_dict(i, message) for i, message in enumerate(messages)]


def _message_dict(i: int, message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):
        content = _content_parts(i, content)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
        out["tool_calls"] = [_history_call(i, j, call) for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
            raise ValueError(f"messages[{i}].tool_call_id: a tool message answers a call (tool_call_id)")
        out["tool_call_id"] = message.tool_call_id
    return out


def _content_parts(i: int, parts: list[dict]) -> str | list[dict]:
    """A message's content parts: their text joined, or — with images — the parts as chat templates take them
    (``{"type": "text", "text"}``, ``{"type": "image", "url"}``: the server fetches the URL before rendering)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in ("image_url", "input_image"):  # Chat Completions' and the Responses API's
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise ValueError(f"messages[{i}].content[{j}].image_url: an image part has an image_url.url")
            out.append({"type": "image", "url": url})
        else:
            raise ValueError(f"messages[{i}].content[{j}]: content parts are text or image_url; got {kind!r}")
    if all(part["type"] == "text" for part in out):
        return "".join(part["text"] for part in out)
    return out


def image_parts(messages: list[dict]) -> list[tuple[str, dict]]:
    """Each image part of :func:`message_dicts`' messages, with where it is (``messages[i].content[j]``)."""
    return [
        (f"messages[{i}].content[{j}]", part)
        for i, message in enumerate(messages)
        if isinstance(message["content"], list)
        for j, part in enumerate(message["content"])
        if part["type"] == "image"
    ]


def _history_call(i: int, j: int, call: dict) -> dict:
    """An assistant's earlier tool call, its arguments parsed (chat templates render objects)."""
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f'{where}: a tool call is {{"id", "type": "function", "function": {{"name", '
            f'"arguments"}}}}; got {str(call)[:120]}'
        )
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object (as text); got {str(arguments)[:120]}")
    return {"id": call.get("id", ""), "type": "function", "function": {"name": function["name"], "arguments": parsed}}


def structured_spec(response_format: dict | None, structured_outputs: dict | None) -> dict | None:
    """The ``SamplingParams.structured_outputs`` dict of a request's ``response_format`` (OpenAI's) or
    ``structured_outputs`` (vLLM's, passed on as it is: ``StructuredOutputs.from_dict`` checks it); None: no
    constraint. Both constraining at once: :class:`InvalidSamplingParams`."""
    from_format = response_format_spec(response_format)
    if from_format is not None and structured_outputs is not None:
        raise InvalidSamplingParams(
            "structured_outputs",
            f"response_format of type {response_format['type']!r} "
            f"and structured_outputs both constrain the output; send one of them",
        )
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
