"""Structured outputs through ``hfaccel serve``, driven by the official ``openai`` client: OpenAI's
``response_format`` (``json_schema``, ``json_object``) and vLLM's ``structured_outputs`` request field (``choice``,
``regex``), streamed and not; a spec that does not compile, a malformed ``response_format`` or both fields at once
is a 400 before anything is admitted, and the server goes on serving.

The served model is a tiny random Llama over SmolLM2's real tokenizer (its flat distributions are the hard case:
nothing but the mask keeps the output in the language).
"""

from __future__ import annotations

import asyncio
import json
import re
from unittest import mock

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers

import hfaccel
from hfaccel.serve.server import ServerConfig, create_app
from tests.assets import smollm2_or_skip
from tests.models import char_tokenizer, tiny_model
from tests.helpers import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_or_skip())
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
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    running = Server(path)
    yield running
    assert running.stop() == 0


def _greedy(**kwargs) -> dict:
    return {"model": "tiny", "temperature": 0, **kwargs}


def test_json_schema_streamed_and_not(server):
    client = server.client()
    full = client.chat.completions.create(messages=MESSAGES, max_tokens=80, response_format=JSON_SCHEMA, **_greedy())
    choice = full.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = choice.message.content  # one layout, no free whitespace: json.dumps's own
    assert text == json.dumps(json.loads(text), ensure_ascii=False)
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES, max_tokens=80, response_format=JSON_SCHEMA, stream=True, **_greedy()
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    sampled = client.completions.create(
        prompt="Person:",
        max_tokens=80,
        temperature=1.3,
        seed=3,
        n=2,
        extra_body={"response_format": JSON_SCHEMA},
        model="tiny",
    )
    for completion in sampled.choices:
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_json_object_choice_and_regex(server):
    client = server.client()
    chunks = client.completions.create(
        prompt="Data:",
        max_tokens=60,
        temperature=1.2,
        seed=1,
        stream=True,
        extra_body={"response_format": {"type": "json_object"}},
        model="tiny",
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert isinstance(json.loads(text), dict), text
    options = ["yes", "no", "maybe so"]
    chat = client.chat.completions.create(
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.5,
        seed=2,
        extra_body={"structured_outputs": {"choice": options}},
        model="tiny",
    )
    assert chat.choices[0].message.content in options
    regex = r"[a-c]{3}-[0-9]{2}"
    out = client.completions.create(
        prompt="Code:", max_tokens=20, extra_body={"structured_outputs": {"regex": regex}}, **_greedy()
    )
    assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    plain = client.chat.completions.create(
        messages=MESSAGES, max_tokens=5, response_format={"type": "text"}, **_greedy()
    )
    assert plain.choices[0].finish_reason == "length"


def _refused(call, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call(**kwargs)
    assert refused.value.status_code == 400
    return refused.value


def test_bad_specs_are_400_and_the_server_goes_on(server):
    client = server.client()
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objet"}}}
    error = _refused(client.chat.completions.create, messages=MESSAGES, response_format=bad_schema, **_greedy())
    assert "the json does not compile" in error.body["message"] and error.body["param"] == "response_format"
    error = _refused(
        client.completions.create,
        prompt="x",
        stream=True,
        **_greedy(),
        extra_body={"structured_outputs": {"regex": "[a-"}},
    )
    assert "the regex does not compile: Regex parsing error" in error.body["message"]
    assert error.body["param"] == "structured_outputs"
    error = _refused(
        client.chat.completions.create,
        messages=MESSAGES,
        **_greedy(),
        response_format={"type": "json_schema", "json_schema": {"name": "x"}},
    )
    assert error.body["message"] == "response_format.json_schema.schema must be a JSON schema (an object); got nothing"
    error = _refused(client.chat.completions.create, messages=MESSAGES, **_greedy(), response_format={"type": "xml"})
    assert "response_format.type must be 'text', 'json_object' or 'json_schema'; got str 'xml'" in error.body["message"]
    error = _refused(client.completions.create, prompt="x", **_greedy(), extra_body={"structured_outputs": {"jsn": {}}})
    assert "unknown fields ['jsn']" in error.body["message"]
    error = _refused(
        client.chat.completions.create,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"choice": ["a"]}},
        **_greedy(),
    )
    assert "both constrain the output" in error.body["message"]
    assert server.wait_idle()["running"] == 0
    out = client.chat.completions.create(messages=MESSAGES, max_tokens=80, response_format=JSON_SCHEMA, **_greedy())
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_without_xgrammar_a_constrained_request_is_400_naming_the_package():
    """In-process (ASGI): xgrammar missing → 400 that says what to install; unconstrained requests still served."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    engine = hfaccel.AsyncEngine(hfaccel.Engine(model, char_tokenizer(), max_num_seqs=2, num_blocks=32, block_size=4))
    app = create_app(engine, ServerConfig(model_name="tiny"))

    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", **body}, timeout=60)

    def missing():
        raise ImportError("structured outputs need xgrammar: pip install 'hfaccel[structured]'")

    try:
        with mock.patch("hfaccel.sampling.structured._xgrammar", missing):
            refused = asyncio.run(post({"response_format": {"type": "json_object"}}))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "response_format"
        assert "pip install 'hfaccel[structured]'" in refused.json()["error"]["message"]
        assert asyncio.run(post({"max_tokens": 2})).status_code == 200
    finally:
        engine.shutdown()
