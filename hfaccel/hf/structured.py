"""``generate()`` constrained to a JSON schema, a regex, a choice of strings or a grammar: a transformers
``LogitsProcessor`` (``hfaccel.structured_logits_processor``) that any model's ``generate`` takes — plain or
accelerated (hfaccel's decode loop runs transformers' logits processors as they are)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from hfaccel.sampling.structured import AfterReasoning, Constraint, StructuredOutputs, apply_masks, shared_grammars


class StructuredLogitsProcessor(LogitsProcessor):
    """Masks each row's logits to the tokens its grammar allows next (EOS only where the grammar may end). It follows
    each row through the tokens ``generate`` appends, and starts over when a new ``generate`` call begins, so one
    processor serves any number of calls (one at a time). Its grammars are the process's (:func:`shared_grammars`):
    a new processor of the same tokenizer and spec compiles nothing."""

    def __init__(self, tokenizer, spec: StructuredOutputs):
        self.tokenizer, self.spec = tokenizer, spec
        self._grammars = shared_grammars(tokenizer, len(tokenizer))
        self._grammars.compile(spec)  # a spec that does not compile raises now
        self._rows: list[Constraint | AfterReasoning] = []
        self._seen: torch.Tensor | None = None  # the last call's input_ids: a call not one token past them starts over

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # input_ids: [B, L], scores: [B, V]
        batch, length = input_ids.shape
        if self._grammars.vocab_size != scores.shape[-1]:  # the model's vocabulary is padded past the tokenizer's
            self._grammars = shared_grammars(self.tokenizer, scores.shape[-1])
        if self._continues(input_ids):
            for row, token in zip(self._rows, input_ids[:, -1].tolist()):  # one read of the last tokens
                if not row.finished:
                    row.accept(token)  # a finished row's padding is refused, and changes nothing
        else:
            self._rows = [self._grammars.constraint(self.spec) for _ in range(batch)]  # a new generate call
        self._seen = input_ids
        masks = [None if row.finished else row for row in self._rows]
        return apply_masks(scores, masks).to(scores.dtype)

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` are the last call's plus one token per row (the same ``generate``'s next step);
        anything else starts a new call. Assisted generation, which scores several tokens at once and rolls back,
        is refused by hfaccel's ``generate`` (:func:`refuse_assisted`)."""
        seen = self._seen
        rows, length = input_ids.shape
        if seen is None or seen.shape != (rows, length - 1) or seen.device != input_ids.device:
            return False
        return torch.equal(seen, input_ids[:, :-1])


def structured_logits_processor(
    tokenizer,
    *,
    json: dict | str | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
) -> StructuredLogitsProcessor:
    """A transformers ``LogitsProcessor`` that constrains ``generate``'s output to exactly one of: a JSON schema
    (``json``), a regex, a ``choice`` of strings, an EBNF ``grammar``, or any JSON object (``json_object=True``):

        processor = hfaccel.structured_logits_processor(tokenizer, json=schema)
        model.generate(**inputs, logits_processor=[processor], max_new_tokens=200)

    A spec that does not compile raises ``ValueError`` with the compiler's message. Needs xgrammar
    (``pip install 'hfaccel[structured]'``)."""
    spec = StructuredOutputs(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object)
    return StructuredLogitsProcessor(tokenizer, spec)


def refuse_assisted(kwargs: dict) -> None:
    """A ``ValueError`` for a ``generate`` call that combines a structured logits processor with assisted or
    speculative generation (drafts would be scored past the grammar and rolled back under it)."""
    processors = kwargs.get("logits_processor") or ()
    if any(isinstance(processor, StructuredLogitsProcessor) for processor in processors):
        raise ValueError(
            "hfaccel.structured_logits_processor follows generate()'s tokens one at a time: it cannot "
            "be combined with assisted generation (assistant_model=, prompt_lookup_num_tokens=); "
            "generate without the assistant, or use the Engine's structured_outputs"
        )
