"""Function calling for ``/v1/chat/completions`` and ``/v1/responses``: the request's tools checked, ``tool_choice``
turned into what the model may write, and the calls read back out of what it wrote.

- ``required`` and a named function: the output is constrained by structured outputs (``hfaccel.sampling.structured``)
  to JSON that parses and matches the function's schema, whatever the model's chat template (as vLLM does): a
  named function's arguments object, or for ``required`` an array of ``{"name", "parameters"}`` objects (at most one
  without ``parallel_tool_calls``).
- ``auto``: the model writes freely and a parser of its family's format finds the calls (:data:`PARSERS`: Hermes /
  Qwen ``<tool_call>`` JSON, Llama 3 JSON, Mistral ``[TOOL_CALLS]``), picked by ``--tool-call-parser`` or from the
  chat template; text that is no call stays content.
- ``none``: no calls are read (the tools still reach the chat template, which may show them to the model).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hfaccel.sampling import InvalidSamplingParams

NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule for a function name (plus "." as vLLM allows)


class ToolError(InvalidSamplingParams):
    """A tool, tool choice or tool-call history the server cannot take; ``param`` names the request field."""


@dataclass(frozen=True)
class Tool:
    """One function a request offers the model."""

    name: str
    description: str | None
    parameters: dict  # its arguments' JSON schema (an object schema)

    def template_dict(self) -> dict:
        """The tool as chat templates take it (OpenAI's chat-completions form)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is JSON text of an object."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        return self if self.id else ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")

    def chat_dict(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def parse_tools(tools: list | None, param: str = "tools", flat: bool = False) -> list[Tool]:
    """A request's ``tools`` (chat completions: ``{"type": "function", "function": {...}}``; ``flat``: the Responses
    API's ``{"type": "function", "name", "parameters", ...}``), or a :class:`ToolError` naming the bad one."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError(param, f"{param} must be a list of tools; got {type(tools).__name__}")
    parsed = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(where, f'{where} must be a function tool ({{"type": "function", ...}}); got {_shown(tool)}')
        body = tool if flat else tool.get("function")
        if not isinstance(body, dict):
            raise ToolError(where, f"{where}.function must be an object with a name; got {_shown(body)}")
        name, parameters = body.get("name"), body.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(
                where, f"{where} needs a name of 1 to 64 letters, digits, '_', '-' or '.'; got {_shown(name)}"
            )
        if not isinstance(parameters, dict):
            raise ToolError(where, f"{where}'s parameters must be a JSON schema (an object); got {_shown(parameters)}")
        description = body.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(where, f"{where}'s description must be a string; got {_shown(description)}")
        parsed.append(Tool(name, description, parameters))
    names = [tool.name for tool in parsed]
    if len(set(names)) != len(names):
        raise ToolError(param, f"{param} names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return parsed


def parse_tool_choice(choice, tools: list[Tool], param: str = "tool_choice", flat: bool = False) -> str | Tool:
    """``"none"``, ``"auto"``, ``"required"`` or the named :class:`Tool` (chat completions:
    ``{"type": "function", "function": {"name"}}``; ``flat``: the Responses API's ``{"type": "function", "name"}``).
    Default: ``auto`` with tools, ``none`` without."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError(param, f"{param}={choice!r} needs tools; the request has none")
        return choice
    body = choice.get("function") if isinstance(choice, dict) and not flat else choice
    name = body.get("name") if isinstance(body, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        form = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
        raise ToolError(
            param, f"{param} must be 'none', 'auto', 'required' or a function ({form}); got {_shown(choice)}"
        )
    tool = next((tool for tool in tools if tool.name == name), None)
    if tool is None:
        raise ToolError(
            param,
            f"{param} names the function {name!r}, which is not among the tools "
            f"({', '.join(t.name for t in tools) or 'none'})",
        )
    return tool


def constrained_schema(choice: str | Tool, tools: list[Tool], parallel: bool) -> dict | None:
    """The JSON schema the output must match for ``choice``: a named function's arguments, or (``required``) an
    array of calls of any of ``tools``; None where the model writes freely."""
    if isinstance(choice, Tool):
        return choice.parameters
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return schema if parallel else {**schema, "maxItems": 1}


def constrained_calls(choice: str | Tool, text: str) -> list[ToolCall]:
    """The calls of an output constrained by :func:`constrained_schema`. Cut short by ``max_tokens``, a named
    function's arguments are as far as they came (as OpenAI's); a ``required`` array that does not parse is no
    call."""
    if isinstance(choice, Tool):
        return [ToolCall(choice.name, text.strip()).with_id()]
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [
        ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)).with_id()
        for call in value
        if isinstance(call, dict) and isinstance(call.get("name"), str)
    ]


# ------------------------------------------------------------------------------------------------ parsers
class ToolParser:
    """Reads the calls out of a model's text in one family's format: ``starts`` are what may begin the calls — at
    any point of the text (``anywhere``; the text before is content) or only at its beginning."""

    name = ""
    starts: tuple[str, ...] = ()
    anywhere = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; text that holds no well-formed call is all content."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes / Qwen 2.5-3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""

    name, starts = "hermes", ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [_call(body) for body in self._block.findall(text)]
        if not calls or any(call is None for call in calls):
            return text, []
        return text[: text.find(self.starts[0])].rstrip(), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3: the output is a JSON object ``{"name": ..., "parameters": {...}}`` (optionally after
    ``<|python_tag|>``), several separated by ``;``."""

    name, starts, anywhere = "llama3_json", ("<|python_tag|>", "{"), False

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(part) for part in _json_objects(body)]
        if not calls or any(call is None for call in calls):
            return text, []
        return "", calls


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or (v11 tokenizers)
    ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name, starts = "mistral", ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.starts[0])
        if at < 0:
            return text, []
        content, rest = text[:at].rstrip(), text[at:]
        calls = []
        for part in rest.split(self.starts[0])[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, arguments = part.partition("[ARGS]")
                calls.append(_call(json.dumps({"name": name.strip(), "arguments": _loads(arguments)})))
            else:
                value = _loads(part)
                items = value if isinstance(value, list) else [value]
                calls += [_call(json.dumps(item)) if isinstance(item, dict) else None for item in items]
        if not calls or any(call is None for call in calls):
            return text, []
        return content, calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


class ToolStream:
    """One output's answer text as it comes, for ``tool_choice="auto"``: passed on as content until something may
    begin a call (only what may be the start of a marker is held back); from there on held, and the calls read
    out at the end (:meth:`finish`). Without a parser everything is content."""

    def __init__(self, parser: ToolParser | None):
        self.parser, self.text, self.sent, self.holding = parser, "", 0, False

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.text += text
        if self.parser is None:
            return self._send(len(self.text))
        if self.holding:
            return ""
        if self.parser.anywhere:  # whitespace is held too: before a call it is not content
            found = [at for at in (self.text.find(start, self.sent) for start in self.parser.starts) if at >= 0]
            if found:
                self.holding = True
                return self._send(len(self.text[: min(found)].rstrip()))
            end = len(self.text) - max(_partial(self.text, s) for s in self.parser.starts)
            return self._send(len(self.text[:end].rstrip()))
        head = self.text.lstrip()
        if any(head.startswith(s) for s in self.parser.starts):
            self.holding = True
            return ""
        if not head or any(s.startswith(head) for s in self.parser.starts):
            return ""
        self.parser = None  # it began with something else: no call can follow
        return self._send(len(self.text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls) at the end of the output."""
        if self.parser is None:
            return self._send(len(self.text)), []
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self._send(len(self.text)), []
        return content[self.sent :], calls  # the content is the text before the calls: what was sent begins it

    def _send(self, end: int) -> str:
        text, self.sent = self.text[self.sent : end], max(self.sent, end)
        return text


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def detect_parser(chat_template: str | None) -> str | None:
    """The parser of the format a chat template writes tool calls in, or None when it shows none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def _call(body: str) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments" | "parameters": {...}}`` JSON text (None if it is not one)."""
    value = _loads(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)).with_id()


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_objects(text: str) -> list[str]:
    """The JSON texts of ``a; b; ...`` (whole objects; a ``;`` inside a string does not split)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return parts


def _shown(value) -> str:
    return f"{type(value).__name__} {json.dumps(value)[:120] if _jsonable(value) else repr(value)[:120]}"


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
