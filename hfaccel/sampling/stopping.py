"""When an output stops: stop tokens (EOS ids normalised once, here), stop strings, the token budget.

:class:`StopChecker` is the one rule the engine and speculative decoding both apply after every token.
Stop strings are found across token boundaries by :class:`IncrementalDetokenizer`: each new token costs two decodes
of a few tokens (not of the whole output): the text of the window
``[prefix_offset, end)`` minus the text of ``[prefix_offset, read_offset)`` — the standard way to get the text
a token adds when tokenizers merge spaces and bytes across tokens. A window ending in an incomplete UTF-8
sequence (``\\ufffd``) waits for the next token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PROMPT_CONTEXT = 6  # prompt tokens decoded with the output so its first token gets its leading space right


class IncrementalDetokenizer:
    """The text of one output, grown token by token, cut at the first stop string."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters a partial stop could span
        self.text = ""
        self.stopped_by: str | None = None

    def add(self, token_id: int, find_stops: bool = True) -> str | None:
        """Add a token; returns the stop string if the text now contains one (the text is cut before it).
        ``find_stops=False``: the text grows and no stop string is looked for (an output below its
        ``min_tokens``)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self._append(full[len(prefix) :], find_stops)
        return None

    def flush(self) -> None:
        """At the end: add whatever the last tokens decode to, even an incomplete character."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self._append(self._decode(self.ids[self.prefix_offset :])[len(prefix) :])
            self.read_offset = len(self.ids)

    def stable_length(self, finished: bool) -> int:
        """Characters that can be shown now: all when finished, else all but what a stop string may still claim."""
        if finished or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self.hold)

    def stable_text(self, finished: bool) -> str:
        return self.text[: self.stable_length(finished)]

    def _append(self, delta: str, find_stops: bool = True) -> str | None:
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        if not find_stops:
            return None
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[:at]
            self.stopped_by = stop
            return stop
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def token_ids(value: int | Iterable[int] | None) -> list[int]:
    """Token ids as a list, whatever form a config, tokenizer or caller gives them in (an int, a list, None)."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token) for token in value]


def eos_token_ids(generation_config, tokenizer=None) -> set[int]:
    """The EOS ids a model's generation config names, plus its tokenizer's EOS token."""
    ids = set(token_ids(generation_config.eos_token_id))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class StopChecker:
    """Decides, token by token, whether one output has ended.

    Args:
        stop_token_ids: tokens that end the output (kept in it): EOS ids and any others.
        detokenizer: the output's text, for stop strings (None: no stop strings).
        max_tokens: the token budget (None: no limit here).
        min_tokens: no stop token or string ends the output before this many tokens (the sampler never draws a
            stop token then: ``SampleRow.banned``).
    """

    def __init__(
        self,
        stop_token_ids: Iterable[int],
        detokenizer: IncrementalDetokenizer | None = None,
        max_tokens: int | None = None,
        min_tokens: int = 0,
    ):
        self.stop_token_ids = frozenset(stop_token_ids)
        self.detokenizer = detokenizer
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens

    def check(self, token: int, num_generated: int) -> tuple[str, int | str | None] | None:
        """After appending ``token`` as output token number ``num_generated``: ``("stop", the token)``,
        ``("stop", the stop string)`` (the text is cut before it), ``("length", None)``, or None to go on."""
        stops = num_generated > self.min_tokens  # the output's first min_tokens tokens end nothing
        if stops and token in self.stop_token_ids:
            return "stop", token
        stop = self.detokenizer.add(token, stops) if self.detokenizer is not None else None
        if stop is not None:
            return "stop", stop
        if self.max_tokens is not None and num_generated >= self.max_tokens:
            return "length", None
        return None
