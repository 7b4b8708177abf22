"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice of strings or an EBNF
grammar — one more constraint on what the sampler may draw.

The grammar library is xgrammar (vLLM's, SGLang's and TensorRT-LLM's default), imported only when a request asks
for a constraint (``pip install 'hfaccel[structured]'``). :class:`Grammars` compiles each spec once per tokenizer
and vocabulary, and :func:`shared_grammars` shares them process-wide (the Engine's requests and every
``structured_logits_processor`` of one tokenizer index its vocabulary once); a sequence holds a
:class:`Constraint` — xgrammar's matcher of its grammar — that fills the row of a token bitmask before each draw and
accepts each token drawn. The mask is applied to the logits on the device (:func:`apply_masks`) before penalties,
warping and the race, so a masked token can never be drawn, greedy or seeded; EOS is allowed only where the grammar
may end.

A reasoning model's output may first think, unconstrained, between two tags (``reasoning``: ``"open"`` when its
prompt ended inside the opening tag, ``"optional"`` when the output may open it with its first token); the
grammar applies to the answer after the closing tag (:class:`AfterReasoning`). Each tag must be one token.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")
REASONING = (None, "open", "optional")
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[10:53:16] /project/cpp/regex_converter.cc:83: "
COMPILED_BYTES = 256 << 20  # the compiled grammars one Grammars keeps (vLLM keeps 512 MiB in xgrammar's cache)


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match — exactly one of:

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it,
            on one line, JSON's standard separators (``", "`` and ``": "``) and no other whitespace.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's / GBNF syntax, ``root ::= ...``).
        json_object: ``True``: any JSON object, on one line (OpenAI's ``response_format={"type": "json_object"}``).
        reasoning: ``"open"``: the output reasons first, unconstrained, until ``reasoning_tags[1]`` (its prompt ended
            inside ``reasoning_tags[0]``); ``"optional"``: it may open a reasoning block with its first token; None:
            the grammar applies from the first token.
        reasoning_tags: the tokens that open and close a reasoning block.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning: str | None = None
    reasoning_tags: tuple[str, str] = ("<think>", "</think>")
    _key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputs takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(f"choice must be a non-empty list of non-empty strings; got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text); got {type(self.json).__name__}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{kind} must be a non-empty string; got {value!r}")
        if self.reasoning not in REASONING:
            raise ValueError(f"reasoning must be one of {REASONING}; got {self.reasoning!r}")
        tags = self.reasoning_tags
        if not (isinstance(tags, tuple) and len(tags) == 2 and all(isinstance(t, str) and t for t in tags)):
            raise ValueError(f"reasoning_tags must be two non-empty strings (opening, closing); got {tags!r}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        object.__setattr__(self, "_key", (kind, value))

    @property
    def kind(self) -> str:
        return self._key[0]

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> StructuredOutputs:
        """From the request field vLLM's clients send (``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``,
        ``{"grammar": ...}``, ``{"json_object": true}``)."""
        if not isinstance(spec, dict):
            raise ValueError(
                f"structured_outputs must be an object with one of {', '.join(KINDS)}; got {type(spec).__name__}"
            )
        unknown = sorted(set(spec) - set(KINDS) - {"reasoning", "reasoning_tags"})
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown fields {unknown}; expected one of {', '.join(KINDS)} (and "
                f"reasoning, reasoning_tags)"
            )
        if isinstance(spec.get("reasoning_tags"), list):
            spec = {**spec, "reasoning_tags": tuple(spec["reasoning_tags"])}
        return cls(**spec)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:  # pragma: no cover - the test extras install it
        raise ImportError("structured outputs need xgrammar: pip install 'hfaccel[structured]'") from error
    return xgrammar


class Grammars:
    """Compiled grammars of one tokenizer and vocabulary, each spec compiled once and kept by xgrammar's cache while
    they fit in ``max_bytes`` (the least recently used go first); a bad spec: ``ValueError`` with the compiler's
    message. The tokenizer is held weakly, so that the process-wide cache (:func:`shared_grammars`) does not keep it
    alive: whoever compiles or makes constraints keeps it."""

    def __init__(self, tokenizer, vocab_size: int, max_bytes: int = COMPILED_BYTES):
        xgr = _xgrammar()
        self._tokenizer = weakref.ref(tokenizer)
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=max_bytes)  # thread-safe

    @property
    def tokenizer(self):
        """The tokenizer, while something else holds it (the Engine, a processor)."""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("these Grammars' tokenizer is gone: get them from shared_grammars(tokenizer, ...)")
        return tokenizer

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec`` (its reasoning tags checked)."""
        if spec.reasoning is not None:
            tag_ids(self.tokenizer, spec.reasoning_tags, self.vocab_size)
        return self._compile(spec)

    def constraint(self, spec: StructuredOutputs) -> Constraint | AfterReasoning:
        """A fresh matcher of ``spec``'s grammar, at the start of the output."""
        compiled = self.compile(spec)

        def grammar() -> Constraint:
            return Constraint(_xgrammar().GrammarMatcher(compiled), self.vocab_size)

        if spec.reasoning is None:
            return grammar()
        start, end = tag_ids(self.tokenizer, spec.reasoning_tags, self.vocab_size)
        return AfterReasoning(grammar, start, end, opened=spec.reasoning == "open")

    def _compile(self, spec: StructuredOutputs):
        compiler, kind = self._compiler, spec.kind
        try:
            if kind in ("json", "json_object"):  # one line: free whitespace would let a model loop in it
                schema = {"type": "object"} if kind == "json_object" else spec.json
                return compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema), any_whitespace=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / its own types with the compiler's message
            lines = str(error).strip().splitlines()
            message = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
            raise ValueError(f"structured_outputs: the {kind} does not compile: {message}") from error


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(len, vocab size): Grammars}
_SHARED_LOCK = threading.Lock()


def shared_grammars(tokenizer, vocab_size: int) -> Grammars:
    """The process's :class:`Grammars` of ``tokenizer`` (its identity and length: tokens added later make new
    ones) over a vocabulary of ``vocab_size`` (the model's, which may pad the tokenizer's): indexing a vocabulary
    takes ~0.2 s, so the Engine and every ``structured_logits_processor`` share them. An entry lives as long as its
    tokenizer."""
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer (give the Engine a tokenizer)")
    key = (len(tokenizer), vocab_size)
    with _SHARED_LOCK:  # one vocabulary index, however many threads ask first
        grammars = _SHARED.setdefault(tokenizer, {})
        if key not in grammars:
            grammars[key] = Grammars(tokenizer, vocab_size)
        return grammars[key]


def tag_ids(tokenizer, tags: Sequence[str], vocab_size: int) -> tuple[int, ...]:
    """The token id of each tag, or a ValueError when one is not a single token of the vocabulary."""
    ids = []
    for tag in tags:
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or encoded[0] >= vocab_size:
            raise ValueError(
                f"structured_outputs: the reasoning tag {tag!r} must be one token of the model's "
                f"vocabulary; the tokenizer makes it {encoded}"
            )
        ids.append(encoded[0])
    return tuple(ids)


def _choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class Constraint:
    """One sequence's place in its grammar (xgrammar's ``GrammarMatcher``)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask [R, ceil(V / 32)]`` (int32, host)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (nothing changes then)."""
        return bool(self.matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        """The grammar has ended (it accepted a stop token)."""
        return bool(self.matcher.is_terminated())


class AfterReasoning:
    """A grammar that waits for the output's reasoning: every token is allowed while the output reasons (from its
    start when ``opened``, or from the opening tag when it draws that first — the first token is the grammar's or
    the opening tag), and the grammar starts after the closing tag."""

    def __init__(self, grammar: Callable[[], Constraint], start: int, end: int, opened: bool):
        self._grammar, self.start, self.end = grammar, start, end
        self.state = "reasoning" if opened else "first"  # then "answer"
        self.answer: Constraint | None = None if opened else grammar()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == "reasoning":
            return  # the row stays all ones: anything may be drawn
        self.answer.fill(bitmask, row)
        if self.state == "first":  # the opening tag too
            word, bit = divmod(self.start, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32's bits

    def accept(self, token: int) -> bool:
        if self.state == "reasoning":
            if token == self.end:
                self.state, self.answer = "answer", self._grammar()
            return True
        if self.state == "first" and token == self.start:
            self.state, self.answer = "reasoning", None
            return True
        if not self.answer.accept(token):
            return False
        self.state = "answer"
        return True

    @property
    def finished(self) -> bool:
        return self.state == "answer" and self.answer.finished


def apply_masks(logits: torch.Tensor, constraints: Sequence[Constraint | AfterReasoning | None]) -> torch.Tensor:
    """``logits [R, V]`` with each constrained row's disallowed tokens at -inf (rows whose constraint is None are
    left as they are), as a new float32 tensor (the caller's logits are not changed: transformers keeps its raw
    scores beside the processed ones); ``logits`` itself when no row is constrained.

    The rows' masks are filled on the host into one ``[R, ceil(V / 32)]`` int32 bitmask (an unconstrained row's
    all ones), which goes to the device in one copy (pinned memory, non-blocking on CUDA), and xgrammar's kernel
    applies it (``xgrammar.apply_token_bitmask_inplace``: Triton on CUDA, its C++ loop on the CPU)."""
    rows = [i for i, constraint in enumerate(constraints) if constraint is not None]
    if not rows:
        return logits
    xgr = _xgrammar()
    device, vocab = logits.device, logits.shape[-1]
    pin = device.type == "cuda"
    bitmask = torch.full(
        xgr.get_bitmask_shape(len(constraints), vocab), -1, dtype=torch.int32, pin_memory=pin
    )  # [R, W], host: all tokens allowed
    for row in rows:
        constraints[row].fill(bitmask, row)
    masked = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [R, V]
    if device.type == "cpu":  # the C++ loop visits only the constrained rows
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows, backend="cpu")
    elif device.type == "cuda":  # one copy; an all-ones row is read and left as it is (indices: a second copy)
        with torch.cuda.device(device):  # Triton launches on the current device
            xgr.apply_token_bitmask_inplace(
                masked, bitmask.to(device, non_blocking=True), vocab_size=vocab, backend="triton"
            )
    else:
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(device), vocab_size=vocab, backend="torch_native")
    return masked
