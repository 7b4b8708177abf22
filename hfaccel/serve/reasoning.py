"""Reasoning models' ``<think>...</think>`` text, kept out of the answer: the message's ``reasoning_content`` (and
``reasoning``, the name vLLM now uses), streamed as deltas of their own.

One rule serves DeepSeek-R1 and Qwen3 (``--reasoning-parser deepseek_r1 | qwen3``, or found in the chat template):
an output reasons until ``</think>`` if its prompt ends inside an open ``<think>`` block (a template that opens it)
or if the output itself opens one, unless its prompt ends with a closed block (Qwen3 with ``enable_thinking``
off); everything after is the answer. An output cut short while reasoning is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # both read <think>...</think>


def detect_reasoning(chat_template: str | None) -> bool:
    """Whether a chat template writes ``<think>`` blocks."""
    return END in (chat_template or "")


def reasoning_mode(prompt: str) -> str | None:
    """Where an output of this rendered prompt reasons: ``"open"`` — the prompt ends inside a ``<think>`` block, the
    output reasons first; None — the prompt ends with a closed block (Qwen3 with ``enable_thinking`` off), the
    output is all answer; ``"optional"`` — the output may open a block."""
    if prompt.rfind(START) > prompt.rfind(END):
        return "open"
    return None if prompt.rstrip().endswith(END) else "optional"


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output; ``opened``: its prompt ended inside a ``<think>`` block."""
    stream = ReasoningStream(opened)
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    answer = "".join(t for kind, t in parts if kind == "content")
    return (reasoning if stream.reasoned else None), answer


@dataclass
class ReasoningStream:
    """Splits an output's text, as it comes, into ``("reasoning", text)`` and ``("content", text)`` parts,
    holding back only what may be the start of a tag."""

    opened: bool  # the prompt ended inside a <think> block
    state: str = ""  # "start" (the output may open a block), "reasoning", "answer" (just after </think>) or "content"
    held: str = ""
    reasoned: bool = False  # some of the output was reasoning

    def __post_init__(self):
        self.state = "reasoning" if self.opened else "start"
        self.reasoned = self.opened

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        parts: list[tuple[str, str]] = []
        while self.held:
            if self.state == "start":
                stripped = self.held.lstrip()
                if START.startswith(stripped):  # may still become <think>
                    return parts
                if stripped.startswith(START):
                    self.state, self.reasoned, self.held = "reasoning", True, stripped[len(START) :]
                    continue
                self.state = "content"
            if self.state == "answer":  # the newlines after </think> are not the answer's, however the text is cut
                self.held = self.held.lstrip("\n")
                if not self.held:
                    break
                self.state = "content"
            if self.state == "content":
                parts.append(("content", self.held))
                self.held = ""
                return parts
            at = self.held.find(END)
            if at >= 0:
                parts.append(("reasoning", self.held[:at]))
                self.state, self.held = "answer", self.held[at + len(END) :]
                continue
            keep = _partial_suffix(self.held, END)
            parts.append(("reasoning", self.held[: len(self.held) - keep]))
            self.held = self.held[len(self.held) - keep :]
            return [(kind, t) for kind, t in parts if t]
        return [(kind, t) for kind, t in parts if t]

    def finish(self) -> list[tuple[str, str]]:
        """What is still held, at the end of the output."""
        held, self.held = self.held, ""
        if not held:
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
