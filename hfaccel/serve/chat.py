"""Chat requests for agents: the prompt rendered by the model's chat template with the request's tools, history and
template arguments, and each output shaped into OpenAI's assistant message — its reasoning apart, its tool calls
read or constrained (``hfaccel.serve.tools``, ``hfaccel.serve.reasoning``) — whole or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfaccel.engine.inputs import check_text
from hfaccel.engine.media import MediaInputs
from hfaccel.serve.reasoning import ReasoningStream, reasoning_mode, split_reasoning
from hfaccel.serve.tools import Tool, ToolCall, ToolParser, ToolStream, constrained_calls

# chat-template arguments the request sets through its own fields (or that would change what the server returns)
RESERVED_TEMPLATE_ARGUMENTS = (
    "conversation",
    "messages",
    "tools",
    "documents",
    "tokenize",
    "return_dict",
    "add_generation_prompt",
    "continue_final_message",
    "return_assistant_tokens_mask",
)


def render_chat(
    engine,
    messages: list[dict],
    tools: list[Tool],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_arguments: dict | None = None,
) -> tuple[str, list[int], MediaInputs | None]:
    """(prompt text, token ids, the images' inputs or None) of a conversation through the engine's chat template —
    its processor's for an image-text-to-text model, which also makes the inputs of the messages' images (their
    parts hold the encoded images) — or a ValueError saying why it cannot be rendered."""
    template = engine.processor or engine.tokenizer
    if template is None or not getattr(template, "chat_template", None):
        raise ValueError("the served model's tokenizer has no chat template; send the prompt to /v1/completions")
    arguments = dict(template_arguments or {})
    reserved = sorted(set(arguments) & set(RESERVED_TEMPLATE_ARGUMENTS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: the request's own fields do")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message: send add_generation_prompt=false with it")
    arguments.update(
        tools=[tool.template_dict() for tool in tools] or None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    if engine.processor is not None:
        text, ids, media = engine.process_prompt(messages, **arguments)
        check_text(text, "the chat's text")
        return text, ids, media
    try:
        text = template.apply_chat_template(messages, tokenize=False, **arguments)
    except Exception as error:  # jinja2's template errors ("roles must alternate", a raise_exception call, ...)
        raise ValueError(f"the tokenizer's chat template rejected the messages: {error}") from None
    check_text(text, "the chat's text")
    return text, template(text, add_special_tokens=False).input_ids, None


@dataclass(frozen=True)
class ChatShape:
    """How a chat call's outputs become assistant messages: the tool choice (``"none"``, ``"auto"``, ``"required"``
    or the named tool), the parser of the model's call format (auto), where the output's reasoning is (``"open"``:
    the prompt opened a ``<think>`` block; ``"optional"``: the output may open one; None: it does not reason or
    it is not split out), and whether the answer was constrained to calls (required, named)."""

    choice: str | Tool = "none"
    parser: type[ToolParser] | None = None
    reasoning: str | None = None
    constrained: bool = False

    @classmethod
    def of(
        cls, choice: str | Tool, parser: type[ToolParser] | None, reasoning: bool, prompt: str, constrained: bool
    ) -> ChatShape:
        return cls(
            choice, parser if choice == "auto" else None, reasoning_mode(prompt) if reasoning else None, constrained
        )

    def message(self, text: str) -> tuple[dict, bool]:
        """(the assistant message of a whole output, whether it calls tools)."""
        reasoning, answer = split_reasoning(text, self.reasoning == "open") if self.reasoning else (None, text)
        content, calls = self._answer(answer)
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [call.chat_dict() for call in calls]
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message, bool(calls)

    def _answer(self, answer: str) -> tuple[str, list[ToolCall]]:
        if self.constrained:  # a required array cut short (max_tokens) may not parse: then the text is content
            calls = constrained_calls(self.choice, answer)
            return ("" if calls else answer), calls
        if self.parser is not None:
            return self.parser().parse(answer)
        return answer, []

    def stream(self) -> ChoiceStream:
        """A per-completion splitter of text deltas into message deltas."""
        return ChoiceStream(self)


@dataclass
class ChoiceStream:
    """One completion's text deltas as OpenAI's chat deltas: ``reasoning_content`` / ``reasoning``, ``content``, and
    ``tool_calls`` (a named function's call header at once and its arguments as they come; other calls when the
    output ends)."""

    shape: ChatShape
    reasoning: ReasoningStream | None = None
    tools: ToolStream | None = None
    answer: str = ""
    header_sent: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self):
        if self.shape.reasoning:
            self.reasoning = ReasoningStream(self.shape.reasoning == "open")
        if not self.shape.constrained:
            self.tools = ToolStream(self.shape.parser() if self.shape.parser is not None else None)

    @property
    def called(self) -> bool:
        return bool(self.calls) or self.header_sent

    def feed(self, text: str) -> list[dict]:
        parts = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return self._deltas(parts)

    def finish(self) -> list[dict]:
        deltas = self._deltas(self.reasoning.finish() if self.reasoning is not None else [])
        if self.shape.constrained:
            if isinstance(self.shape.choice, Tool):
                return deltas
            self.calls = constrained_calls(self.shape.choice, self.answer)
            if not self.calls:
                return deltas + ([{"content": self.answer}] if self.answer else [])
            return deltas + [{"tool_calls": [call.chat_dict(i)]} for i, call in enumerate(self.calls)]
        rest, self.calls = self.tools.finish()
        deltas += [{"content": rest}] if rest else []
        return deltas + [{"tool_calls": [call.chat_dict(i)]} for i, call in enumerate(self.calls)]

    def _deltas(self, parts: list[tuple[str, str]]) -> list[dict]:
        deltas = []
        for kind, text in parts:
            if kind == "reasoning":
                deltas.append({"reasoning_content": text, "reasoning": text})
            elif self.shape.constrained:
                deltas += self._constrained(text)
            elif content := self.tools.feed(text):
                deltas.append({"content": content})
        return deltas

    def _constrained(self, text: str) -> list[dict]:
        """A named function's arguments stream as they come (after one header delta); ``required``'s array is read
        when the output ends."""
        self.answer += text
        if not isinstance(self.shape.choice, Tool):
            return []
        deltas = []
        if not self.header_sent:
            self.header_sent = True
            call = ToolCall(self.shape.choice.name, "").with_id()
            deltas.append({"tool_calls": [call.chat_dict(0)]})
        deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas
