"""The compiled grammars' caches: one :class:`Grammars` per tokenizer and vocabulary in the process, which does not
keep its tokenizer alive, and in it the compiled grammars, the least recently used dropped past its byte bound."""

import gc
import weakref

from hfaccel.sampling.structured import Grammars, StructuredOutputs, shared_grammars
from tests.models import char_tokenizer


def test_one_grammars_per_tokenizer_and_vocabulary_while_the_tokenizer_lives():
    tokenizer = char_tokenizer()
    grammars = shared_grammars(tokenizer, 96)
    assert shared_grammars(tokenizer, 96) is grammars
    assert shared_grammars(tokenizer, 128).vocab_size == 128  # a model's vocabulary padded past the tokenizer's
    assert shared_grammars(char_tokenizer(), 96) is not grammars  # another tokenizer, even an equal one
    tokenizer.add_tokens(["<think>"])
    assert shared_grammars(tokenizer, 96) is not grammars  # tokens added: its vocabulary is indexed again
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None and grammars.tokenizer is None


def test_the_least_recently_used_grammars_go_past_the_byte_bound(monkeypatch):
    compiled, compile_once = [], Grammars._compile

    def counted(grammars, spec):
        compiled.append(spec.regex)
        return compile_once(grammars, spec)

    monkeypatch.setattr(Grammars, "_compile", counted)
    tokenizer = char_tokenizer()
    size = Grammars(tokenizer, 96).compile(StructuredOutputs(regex="a+")).memory_size_bytes
    grammars = Grammars(tokenizer, 96, max_bytes=2 * size)  # room for two grammars of this size
    compiled.clear()
    for regex in ("a+", "b+", "a+", "c+", "a+", "b+"):  # "c+" drops "b+" (used less recently than "a+")
        grammars.compile(StructuredOutputs(regex=regex))
    assert compiled == ["a+", "b+", "c+", "b+"]
    assert grammars._bytes == 2 * size
