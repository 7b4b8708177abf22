"""Structured outputs in the Engine, with SmolLM2's real tokenizer over a tiny random model (greedy and seeded
draws over its flat distributions are the hard case: nothing but the mask keeps them in the language): JSON schemas
validate (the ``jsonschema`` library), regexes full-match, choices are in the set; unconstrained neighbours keep
their own tokens; preemption, n > 1, seeds and logprobs keep working; a spec that does not compile is refused."""

from __future__ import annotations

import json
import re
from unittest import mock

import jsonschema
import pytest
import torch
import transformers

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.engine.scheduler import Scheduler
from hfaccel.sampling import InvalidSamplingParams, StructuredOutputs
from hfaccel.sampling.structured import Constraint, apply_masks
from tests.assets import smollm2_or_skip

NAME = {"type": "string", "maxLength": 6}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": SMALL},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"x": SMALL, "y": SMALL},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"a": SMALL, "b": NAME}, "required": ["a"], "additionalProperties": False},
    {"type": "boolean"},
    {"enum": [1, 2, "three", None]},
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "at": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2},
        },
        "required": ["kind", "at"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["level"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [SMALL, {"type": "boolean"}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"k": NAME}, "required": ["k"], "additionalProperties": False},
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {"nothing": {"type": "null"}},
        "required": ["nothing"],
        "additionalProperties": False,
    },
    {"type": "string", "enum": ["yes", "no"]},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {
                    "q": {
                        "type": "object",
                        "properties": {"r": {"type": "boolean"}},
                        "required": ["r"],
                        "additionalProperties": False,
                    }
                },
                "required": ["q"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {"type": "integer", "minimum": 10, "maximum": 20},
    {
        "type": "object",
        "properties": {
            "name": NAME,
            "scores": {"type": "array", "items": SMALL, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["name", "scores", "active"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(smollm2_or_skip())


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    return hfaccel.accelerate(transformers.AutoModelForCausalLM.from_config(config).eval(), attention="torch")


def _engine(model, tokenizer, **kwargs) -> Engine:
    return Engine(model, tokenizer, max_num_seqs=32, **{"num_blocks": 512, **kwargs})


def test_json_schemas_validate(model, tokenizer):
    """20 schemas (nested objects, arrays, enums, required fields, bounded numbers, formats, patterns), greedy and
    seeded at temperature 1.5, all in one batch: every output parses and validates."""
    params = [
        SamplingParams(
            max_tokens=160, temperature=0 if i % 2 else 1.5, seed=i, structured_outputs=StructuredOutputs(json=schema)
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    outputs = _engine(model, tokenizer).generate([f"Answer {i}:" for i in range(len(SCHEMAS))], params)
    for schema, output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_grammar_and_json_object(model, tokenizer):
    specs = [
        {"regex": r"[a-c]{3}-[0-9]{2}"},
        {"regex": r"(cat|dog)s?"},
        {"choice": ["yes", "no", "maybe so"]},
        {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'},
        {"json_object": True},
    ]
    params = [
        SamplingParams(max_tokens=48, temperature=1.3, seed=7 + i, structured_outputs=spec)
        for i, spec in enumerate(specs)
    ]
    texts = [o.outputs[0].text for o in _engine(model, tokenizer).generate(["Go:"] * len(specs), params)]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", texts[0]) and re.fullmatch(r"(cat|dog)s?", texts[1])
    assert texts[2] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)?\)", texts[3]), texts[3]
    assert isinstance(json.loads(texts[4]), dict)


def test_unconstrained_neighbours_keep_their_tokens(model, tokenizer):
    """Greedy and seeded unconstrained requests give the same tokens alone and beside constrained ones (asynchronous
    scheduling on, as on a GPU: a constrained request turns the overlap off, which changes no token)."""
    free = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=1.2, seed=5)]
    engine = _engine(model, tokenizer, async_scheduling=True)
    alone = [o.outputs[0].token_ids for o in engine.generate(["one two", "three"], free)]
    constrained = SamplingParams(max_tokens=30, structured_outputs={"json": SCHEMAS[0]}, temperature=0)
    mixed = engine.generate(["one two", "x", "three", "y"], [free[0], constrained, free[1], constrained])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_preempted_request_still_validates(model, tokenizer):
    """A pool too small for every request at once: constrained requests are preempted (recomputed) mid-output and
    still validate; n = 2 completions and logprobs on a constrained request."""
    preempted = []
    real = Scheduler._preempt

    def spy(self, seq, out):
        preempted.append(seq.request.request_id)
        return real(self, seq, out)

    schema = SCHEMAS[19]
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=0.9,
            seed=11 + i,
            n=2 if i == 0 else 1,
            logprobs=2,
            structured_outputs={"json": schema},
        )
        for i in range(6)
    ]
    with mock.patch.object(Scheduler, "_preempt", spy):
        outputs = _engine(model, tokenizer, num_blocks=12, block_size=8).generate(["Tell me:"] * 6, params)
    assert preempted
    completions = [c for output in outputs for c in output.outputs]
    assert len(completions) == 7
    for completion in completions:
        assert completion.finish_reason == "stop" and len(completion.logprobs) == len(completion.token_ids)
        jsonschema.validate(json.loads(completion.text), schema)


def test_max_tokens_cuts_a_constrained_output_inside_the_language(model, tokenizer):
    output = (
        _engine(model, tokenizer)
        .generate("x", SamplingParams(max_tokens=3, temperature=0, structured_outputs={"json": SCHEMAS[19]}))[0]
        .outputs[0]
    )
    assert output.finish_reason == "length" and output.text.startswith("{")


def test_a_spec_that_does_not_compile_is_refused_and_the_engine_goes_on(model, tokenizer):
    engine = _engine(model, tokenizer)
    with pytest.raises(ValueError, match="the regex does not compile: Regex parsing error"):
        engine.add_request("x", SamplingParams(structured_outputs={"regex": "[a-"}))
    with pytest.raises(ValueError, match="the json does not compile"):
        engine.add_request("x", SamplingParams(structured_outputs={"json": '{"type": "objet"}'}))
    assert not engine.has_unfinished_requests()
    out = engine.generate("x", SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["a", "b"]}))
    assert out[0].outputs[0].text in ("a", "b")
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        Engine(model, None, num_blocks=64).add_request([5, 6], SamplingParams(structured_outputs={"choice": ["a"]}))


@pytest.fixture(scope="module")
def think_model():
    """SmolLM2's tokenizer with <think> and </think> as single tokens (as Qwen3's and DeepSeek-R1's are)."""
    from tests.serve.agent_models import smollm2_tokenizer, tiny_model_over

    tokenizer = smollm2_tokenizer(qwen_style=True)
    return hfaccel.accelerate(tiny_model_over(tokenizer), attention="torch"), tokenizer


def test_the_grammar_waits_for_the_reasoning(think_model):
    """``reasoning="open"``: every token until </think> is the unconstrained one (equal to a request without the
    constraint), the answer after it validates; ``"optional"``: the first token is the grammar's or <think>."""
    model, tokenizer = think_model
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    engine = _engine(model, tokenizer)
    schema = SCHEMAS[1]
    free, opened = engine.generate(
        ["Think:"] * 2,
        [
            SamplingParams(max_tokens=9, temperature=0),
            SamplingParams(max_tokens=9, temperature=0, structured_outputs={"json": schema, "reasoning": "open"}),
        ],
    )
    assert opened.outputs[0].token_ids == free.outputs[0].token_ids and end not in free.outputs[0].token_ids
    closing = SamplingParams(
        max_tokens=40, temperature=0, logit_bias={end: 100.0}, structured_outputs={"json": schema, "reasoning": "open"}
    )
    answer = engine.generate("Think:", closing)[0].outputs[0]
    assert answer.token_ids[0] == end and answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text.removeprefix("</think>")), schema)
    # optional: </think> is not allowed first (so <think> is drawn), then it closes the block at once
    optional = SamplingParams(
        max_tokens=40,
        temperature=0,
        logit_bias={start: 50.0, end: 100.0},
        structured_outputs={"json": schema, "reasoning": "optional"},
    )
    answer = engine.generate("Think:", optional)[0].outputs[0]
    assert answer.token_ids[:2] == [start, end] and answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text.removeprefix("<think></think>")), schema)
    # without reasoning the grammar holds from the first token: neither tag can be drawn
    strict = SamplingParams(
        max_tokens=40, temperature=0, logit_bias={start: 100.0, end: 100.0}, structured_outputs={"json": schema}
    )
    jsonschema.validate(json.loads(engine.generate("Think:", strict)[0].outputs[0].text), schema)


def test_reasoning_tags_must_be_single_tokens(model, tokenizer):
    with pytest.raises(ValueError, match="the reasoning tag '<think>' must be one token"):
        _engine(model, tokenizer).add_request(
            "x", SamplingParams(structured_outputs={"json_object": True, "reasoning": "open"})
        )
    with pytest.raises(ValueError, match="reasoning must be one of"):
        StructuredOutputs(json_object=True, reasoning="sometimes")


def test_bad_specs_are_clear_errors():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputs(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputs(choice="ab")
    with pytest.raises(InvalidSamplingParams, match="unknown fields \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InvalidSamplingParams, match="structured_outputs must be None, a StructuredOutputs or a dict"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputs(regex="a+")


def _reference_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The unpack-based masking apply_masks did before it used xgrammar's kernel: bit ``j % 32`` of word ``j // 32``
    of a row allows token ``j``; the listed rows' other tokens go to -inf."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [R, V]
    out = logits.float().clone()
    for row in rows:
        out[row] = out[row].masked_fill(~allowed[row], float("-inf"))
    return out


class _FixedMatcher:
    """A matcher stand-in that writes a fixed bitmask row."""

    def __init__(self, words: torch.Tensor):
        self.words = words

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.words


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_masks_matches_the_unpacked_reference(device, dtype):
    """xgrammar's kernel (apply_masks) equals the unpack + masked_fill reference on random bitmasks with an odd
    vocabulary (its last word part-used), constrained and unconstrained rows mixed, non-contiguous logits; the
    input logits are not changed and the result is float32."""
    generator = torch.Generator().manual_seed(0)
    for rows, vocab in [(7, 1001), (1, 33), (4, 49153), (3, 31)]:
        words = -(-vocab // 32)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=generator, dtype=torch.int32)
        bitmask[0, 0] = 0  # a row that forbids a whole word
        constrained = [row for row in range(rows) if row % 3 != 1] or [0]
        constraints = [
            Constraint(_FixedMatcher(bitmask[row]), vocab) if row in constrained else None for row in range(rows)
        ]
        logits = torch.randn(vocab, rows, generator=generator).t().to(device, dtype)  # [R, V], non-contiguous
        before = logits.clone()
        masked = apply_masks(logits, constraints)
        assert torch.equal(logits, before)
        assert masked.dtype == torch.float32 and masked.device == logits.device
        assert torch.equal(masked.cpu(), _reference_masks(logits.cpu(), bitmask, constrained))
    free = torch.randn(2, 40)
    assert apply_masks(free, [None, None]) is free  # nothing constrained: the logits as they are
