"""``hfaccel.structured_logits_processor`` in ``generate()``: the same constrained tokens from a plain model and from
the same model accelerated (hfaccel's decode loop serving), greedy and sampled, a left-padded batch; one processor
serves several calls; a model vocabulary padded past the tokenizer's; a new processor of the same tokenizer and
spec compiles nothing."""

import copy
import re

import pytest
import torch
import transformers
import xgrammar

import hfaccel
from hfaccel.sampling.structured import shared_grammars
from tests.assets import smollm2_or_skip


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_or_skip())
    tokenizer.padding_side = "left"
    return tokenizer


def _model(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + 64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_plain_and_accelerated_generate_give_the_same_constrained_tokens(tokenizer):
    plain = _model(tokenizer)
    fast = hfaccel.accelerate(copy.deepcopy(plain), attention="torch")  # "torch": hfaccel's loop on the CPU too
    processor = hfaccel.structured_logits_processor(tokenizer, regex=r"[a-c]{3}-[0-9]{2}")
    batch = tokenizer(["Hello there, how are you", "Hi"], return_tensors="pt", padding=True)
    prompt = batch["input_ids"].shape[1]
    for sampling in (dict(do_sample=False), dict(do_sample=True, temperature=1.5)):
        kwargs = dict(max_new_tokens=10, logits_processor=[processor], pad_token_id=0, **sampling)
        torch.manual_seed(3)
        expected = plain.generate(**batch, **kwargs)
        torch.manual_seed(3)
        got = fast.generate(**batch, **kwargs)
        assert fast.hfaccel.decode.path == "hfaccel"
        assert torch.equal(got, expected)
        for text in tokenizer.batch_decode(got[:, prompt:], skip_special_tokens=True):
            assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text), text


def test_choice_and_bad_specs(tokenizer):
    model = _model(tokenizer)
    processor = hfaccel.structured_logits_processor(tokenizer, choice=["red", "green"])
    batch = tokenizer(["Pick:"], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, logits_processor=[processor], pad_token_id=0)
    assert tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True) in ("red", "green")
    with pytest.raises(ValueError, match="the grammar does not compile"):
        hfaccel.structured_logits_processor(tokenizer, grammar="root ::= (")
    with pytest.raises(ValueError, match="exactly one of"):
        hfaccel.structured_logits_processor(tokenizer, regex="a", choice=["a"])


def test_assisted_generation_is_refused_clearly(tokenizer):
    model = hfaccel.accelerate(_model(tokenizer), attention="torch")
    processor = hfaccel.structured_logits_processor(tokenizer, regex=r"[a-c]{3}-[0-9]{2}")
    batch = tokenizer(["Hello"], return_tensors="pt")
    with pytest.raises(ValueError, match="cannot be combined with assisted generation"):
        model.generate(
            **batch,
            max_new_tokens=8,
            do_sample=False,
            logits_processor=[processor],
            pad_token_id=0,
            prompt_lookup_num_tokens=3,
        )


def test_a_new_processor_of_the_same_tokenizer_and_spec_compiles_nothing(tokenizer, monkeypatch):
    """A ``generate`` call with a new processor (the usual way to call it) pays no vocabulary index and no compile
    after the first one in the process (the compiled grammars held do not grow), and draws the same tokens."""
    indexed = []
    index = xgrammar.TokenizerInfo.from_huggingface
    monkeypatch.setattr(
        xgrammar.TokenizerInfo, "from_huggingface", staticmethod(lambda *a, **k: indexed.append(1) or index(*a, **k))
    )
    model = _model(tokenizer)
    batch = tokenizer(["Your city:"], return_tensors="pt")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}

    def generate() -> tuple[torch.Tensor, int]:
        processor = hfaccel.structured_logits_processor(tokenizer, json=schema)
        out = model.generate(**batch, max_new_tokens=16, do_sample=False, logits_processor=[processor], pad_token_id=0)
        grammars = shared_grammars(tokenizer, model.config.vocab_size)
        assert processor._grammars is grammars  # the Engine's too
        return out, grammars._compiler.get_cache_size_bytes()

    first, held = generate()
    assert held > 0
    indexed.clear()
    again, held_again = generate()
    assert torch.equal(again, first) and held_again == held and not indexed
