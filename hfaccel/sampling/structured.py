"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice of strings or an EBNF
grammar — one more constraint on what the sampler may draw.

The grammar library is xgrammar (vLLM's, SGLang's and TensorRT-LLM's default), imported only when a request asks
for a constraint (``pip install 'hfaccel[structured]'``). :class:`Grammars` compiles each spec once per tokenizer
(cached); a sequence holds a :class:`Constraint` — xgrammar's matcher of its grammar — that fills the row of a
token bitmask before each draw and accepts each token drawn. The mask is applied to the logits on the device
(:func:`apply_masks`) before penalties, warping and the race, so a masked token can never be drawn, greedy or
seeded; EOS is allowed only where the grammar may end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[10:53:16] /project/cpp/regex_converter.cc:83: "


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
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    _key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) and c
                                                                          for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings; got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text); got {type(self.json).__name__}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{kind} must be a non-empty string; got {value!r}")
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
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}; got "
                             f"{type(spec).__name__}")
        unknown = sorted(set(spec) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}; expected one of {', '.join(KINDS)}")
        return cls(**spec)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:  # pragma: no cover - the test extras install it
        raise ImportError("structured outputs need xgrammar: pip install 'hfaccel[structured]'") from error
    return xgrammar


class Grammars:
    """Compiled grammars of one tokenizer and vocabulary, each spec compiled once (a bad spec: ``ValueError`` with
    the compiler's message)."""

    def __init__(self, tokenizer, vocab_size: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (give the Engine a tokenizer)")
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[tuple, Any] = {}

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec``."""
        if spec._key not in self._compiled:
            self._compiled[spec._key] = self._compile(spec)
        return self._compiled[spec._key]

    def constraint(self, spec: StructuredOutputs) -> Constraint:
        """A fresh matcher of ``spec``'s grammar, at the start of the output."""
        return Constraint(_xgrammar().GrammarMatcher(self.compile(spec)), self.vocab_size)

    def _compile(self, spec: StructuredOutputs):
        compiler, kind = self._compiler, spec.kind
        try:
            if kind in ("json", "json_object"):  # one line: free whitespace would let a model loop in it
                schema = {"type": "object"} if kind == "json_object" else spec.json
                return compiler.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                    any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / its own types with the compiler's message
            lines = str(error).strip().splitlines()
            message = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(error).__name__
            raise ValueError(f"structured_outputs: the {kind} does not compile: {message}") from error


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


def apply_masks(logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> torch.Tensor:
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
    bitmask = torch.full(xgr.get_bitmask_shape(len(constraints), vocab), -1, dtype=torch.int32,
                         pin_memory=pin)  # [R, W], host: all tokens allowed
    for row in rows:
        constraints[row].fill(bitmask, row)
    masked = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [R, V]
    if device.type == "cpu":  # the C++ loop visits only the constrained rows
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows, backend="cpu")
    elif device.type == "cuda":  # one copy; an all-ones row is read and left as it is (indices: a second copy)
        with torch.cuda.device(device):  # Triton launches on the current device
            xgr.apply_token_bitmask_inplace(masked, bitmask.to(device, non_blocking=True), vocab_size=vocab,
                                            backend="triton")
    else:
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(device), vocab_size=vocab, backend="torch_native")
    return masked
