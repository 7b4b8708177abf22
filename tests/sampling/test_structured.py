"""The compiled grammars' cache: one :class:`Grammars` per tokenizer and vocabulary in the process, which does not
keep its tokenizer alive."""

import gc
import weakref

import pytest

from hfaccel.sampling.structured import shared_grammars
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
    assert gone() is None
    with pytest.raises(RuntimeError, match="tokenizer is gone"):
        grammars.tokenizer
