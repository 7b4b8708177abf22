"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery: a request's ``input`` items become chat
messages for the model's template, and the assistant message the output makes (``hfaccel.serve.chat``: reasoning,
content, tool calls) becomes Responses output items — whole, or as the Responses stream's events.

Conversation state lives in a bounded in-memory :class:`ResponseStore`: a response made with ``store`` (the
default) can be continued by ``previous_response_id`` until it is among the oldest beyond the bound.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import Field

from hfaccel.engine import CompletionOutput, RequestOutput
from hfaccel.sampling import InvalidSamplingParams
from hfaccel.serve.chat import ChatShape
from hfaccel.serve.errors import APIError
from hfaccel.serve.protocol import ChatMessage, SamplingRequest, message_dicts, structured_spec
from hfaccel.serve.shaping import CallShaper, cached_tokens, sse_event

# Responses input items turned into chat messages; others are refused (a reasoning item is dropped: chat templates
# do not show earlier turns' reasoning)
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(SamplingRequest):
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict | None = None  # vLLM's, as on chat completions

    @property
    def structured_field(self) -> str:
        return "structured_outputs" if self.structured_outputs is not None else "text"

    def structured_request(self) -> dict | None:
        """``text.format`` (or vLLM's ``structured_outputs``) as a ``StructuredOutputs`` dict; None: none."""
        if self.response_format is not None:
            raise InvalidSamplingParams(
                "response_format",
                "the Responses API sets the output's format in text.format; response_format is chat completions'",
            )
        return structured_spec(self._text_format(), self.structured_outputs)

    def _text_format(self) -> dict | None:
        """``text.format`` in chat completions' ``response_format`` form (the Responses API flattens
        ``json_schema``'s fields into the format object)."""
        if self.text is None or self.text.get("format") is None:
            return None
        form = self.text["format"]
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            return form if isinstance(form, dict) else {"type": form}  # refused by structured_spec, naming it
        return {"type": "json_schema", "json_schema": {key: form.get(key) for key in ("name", "schema", "strict")}}


def input_messages(input: str | list[dict], param: str = "input") -> list[dict]:
    """A request's ``input`` as OpenAI chat messages (``hfaccel.serve.protocol.ChatMessage`` dicts): messages as
    they are, function calls as an assistant's ``tool_calls`` (consecutive calls: one message), their outputs as tool
    messages. A malformed item is a ValueError naming it."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    messages: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool message answering it
    for i, item in enumerate(input):
        where = f"{param}[{i}]"
        kind = item.get("type", "message")
        if kind not in INPUT_ITEMS:
            raise ValueError(f"{where}: items of type {kind!r:.40} are not supported ({', '.join(INPUT_ITEMS)})")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.call_id: a function call's output names its call; got {call_id!r:.40}")
            message = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), where)}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
    return messages


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list) or any(
        not isinstance(part, dict) or part.get("type") not in TEXT_PARTS for part in content
    ):
        raise ValueError(
            f"{where}.content: only text and text parts ({', '.join(TEXT_PARTS)}) are supported "
            f"(no images, files or audio); got {str(content):.120}"
        )
    return "".join(str(part.get("text", "")) for part in content)


def _function_call(item: dict, where: str) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(
            f"{where}: a function_call item has a call_id, a name and its arguments as JSON text; got {str(item):.120}"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ------------------------------------------------------------------------------------------------- output
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItems:
    """A response's output items built from the chat deltas of its assistant message (``ChoiceStream``'s), with
    the Responses stream events that build them: reasoning, a message's text and function calls, each item opened
    when its first delta comes and done when the next begins or the output ends."""

    items: list[dict] = field(default_factory=list)
    _open: dict | None = None

    def feed(self, deltas: list[dict]) -> list[dict]:
        """The events of these chat deltas (``{"reasoning_content"}``, ``{"content"}`` or ``{"tool_calls"}``)."""
        events = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def finish(self) -> list[dict]:
        """The events closing the last item."""
        return self._close()

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self._open is not None and self._open["type"] == kind else self._close() + self._start(kind)
        item, at = self._open, len(self.items) - 1
        if kind == "reasoning":
            item["content"][0]["text"] += text
            return events + [
                {
                    "type": "response.reasoning_text.delta",
                    "item_id": item["id"],
                    "output_index": at,
                    "content_index": 0,
                    "delta": text,
                }
            ]
        item["content"][0]["text"] += text
        return events + [
            {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": at,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        ]

    def _call(self, call: dict) -> list[dict]:
        events = []
        if call.get("id"):  # a new call: its header
            events += self._close()
            item = {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            events += self._add(item)
        item, at = self._open, len(self.items) - 1
        arguments = call["function"].get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": at,
                    "delta": arguments,
                }
            )
        return events

    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            return self._add(
                {
                    "type": "reasoning",
                    "id": _id("rs"),
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress",
                }
            )
        events = self._add(
            {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        return events + [
            {
                "type": "response.content_part.added",
                "item_id": self._open["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "part": {**part},
            }
        ]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if "content" in item and item["type"] == "message" else dict(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": shown}]

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = len(self.items) - 1
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            ]
        elif item["type"] == "reasoning":
            events = [
                {
                    "type": "response.reasoning_text.done",
                    **where,
                    "content_index": 0,
                    "text": item["content"][0]["text"],
                }
            ]
        else:
            part = item["content"][0]
            events = [
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        return events + [{"type": "response.output_item.done", "output_index": at, "item": item}]

    def message(self) -> dict:
        """The assistant's chat message of these items (what ``previous_response_id`` continues from)."""
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.items
            if item["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


@dataclass
class StoredResponse:
    body: dict
    messages: list[dict]  # the conversation, the response's own message last (instructions are per request)


class ResponseStore:
    """The last ``capacity`` stored responses, by id (0: none are kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def put(self, response_id: str, response: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._responses[response_id] = response
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)


class ResponsesShaper(CallShaper):
    """A ``/v1/responses`` call: its output as Responses items, whole or streamed as the Responses events (each
    with its ``sequence_number``), and the response stored for ``previous_response_id``."""

    def __init__(
        self, tokenizer, store: ResponseStore, request: ResponsesRequest, shape: ChatShape, messages: list[dict]
    ):
        super().__init__(tokenizer, "resp", "response", 1, chat=True, model=request.model, shape=shape)
        self.store, self.request, self.messages = store, request, messages
        self.items, self.choice_stream = OutputItems(), shape.stream()
        self._sequence = 0

    def complete(self, output: RequestOutput) -> dict:
        """The Response of a finished output (stored if asked)."""
        completion = output.outputs[0]
        self.items.feed(self.choice_stream.feed(completion.text) + self.choice_stream.finish())
        self.items.finish()
        return self._finished(output, len(completion.token_ids), completion.finish_reason)

    def opening(self) -> list[str]:
        response = self._response("in_progress")
        return self._events(
            [{"type": "response.created", "response": response}, {"type": "response.in_progress", "response": response}]
        )

    def delta_events(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> list[str]:
        stream = self.choice_stream
        deltas = stream.feed(completion.text) + (stream.finish() if completion.finish_reason else [])
        events = self.items.feed(deltas)
        if completion.finish_reason:
            events += self.items.finish()
        return self._events(events)

    def error_event(self, error: APIError) -> str:
        return self._events([{"type": "error", "code": error.code, "message": error.message, "param": error.param}])[0]

    def closing(self, finals: list[RequestOutput] | None, include_usage: bool, usage: dict) -> list[str]:
        if finals is None:
            return []
        last = finals[0]
        response = self._finished(
            last, usage["completion_tokens"], last.outputs[0].finish_reason if last.outputs else None
        )
        return self._events([{"type": f"response.{response['status']}", "response": response}])

    def _finished(self, last: RequestOutput, output_tokens: int, finish_reason: str | None) -> dict:
        """The finished Response (``last``: the output, or a stream's last delta), stored if asked."""
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        reasoning = "".join(item["content"][0]["text"] for item in self.items.items if item["type"] == "reasoning")
        usage = _usage(
            len(last.prompt_token_ids),
            output_tokens,
            cached_tokens(last),
            len(self.tokenizer(reasoning, add_special_tokens=False).input_ids) if reasoning else 0,
        )
        response = self._response("incomplete" if incomplete else "completed", usage, incomplete)
        if self.request.store:
            reply = message_dicts([ChatMessage.model_validate(self.items.message())])  # as the template takes it
            self.store.put(self.id, StoredResponse(response, self.messages + reply))
        return response

    def _response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        """The Response object, as it stands."""
        request = self.request
        tool_choice = request.tool_choice if request.tool_choice is not None else ("auto" if request.tools else "none")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.items.items,
            "error": None,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": request.instructions,
            "metadata": request.metadata or {},
            "tools": request.tools or [],
            "tool_choice": tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "text": request.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
        }

    def _events(self, events: list[dict]) -> list[str]:
        lines = []
        for event in events:
            lines.append(f"event: {event['type']}\n" + sse_event({**event, "sequence_number": self._sequence}))
            self._sequence += 1
        return lines


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses API's ``usage`` object."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }
