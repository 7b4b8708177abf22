"""LoRA adapters through ``hfaccel serve BASE --lora name=path``, driven by the official ``openai`` client: a request's
``model`` picks the adapter (the served name: the base model), each adapter's completion equals the Engine's, streamed
or not, in one batch with the others; ``/v1/models`` lists the base and the adapters; an unknown model is a 404.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import transformers

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from tests.lora.adapters import save_adapter
from tests.models import char_tokenizer, tiny_model
from tests.helpers import CHAT_TEMPLATE, Server

PROMPTS = ["hello there", "The quick brown fox", "abc"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served-lora")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    base = tiny_model("llama")
    base.save_pretrained(path / "base")
    tokenizer.save_pretrained(path / "base")
    save_adapter(base, path / "alpha", r=8, seed=1)
    save_adapter(base, path / "beta", r=16, seed=2)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    running = Server(
        model_dir / "base",
        "--lora",
        f"alpha={model_dir / 'alpha'}",
        "--lora",
        f"beta={model_dir / 'beta'}",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "2",
    )
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def expected(model_dir) -> dict:
    """The Engine's greedy texts of each prompt under each model name (in this process)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "base").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir / "base")
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"),
        tokenizer,
        num_blocks=256,
        lora_adapters={"alpha": model_dir / "alpha", "beta": model_dir / "beta"},
        max_lora_rank=16,
    )
    texts = {}
    for name, lora in (("tiny", None), ("alpha", "alpha"), ("beta", "beta")):
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora=lora)
        texts[name] = [(out.outputs[0].text, out.outputs[0].finish_reason) for out in outs]
    engine.close()
    assert texts["alpha"] != texts["tiny"] and texts["beta"] != texts["tiny"] and texts["alpha"] != texts["beta"]
    return texts


def _complete(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.model == model
    return out.choices[0].text, out.choices[0].finish_reason


def test_each_adapter_completes_as_the_engine_does(server, expected):
    client = server.client()
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("alpha", "tiny", "beta")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # at once: adapters and the base share the server's batches
        got = list(pool.map(lambda job: _complete(client, job[0], PROMPTS[job[1]]), jobs))
    assert got == [expected[name][i] for name, i in jobs]
    chunks = list(
        client.completions.create(model="beta", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected["beta"][1][0]
    assert {c.model for c in chunks} == {"beta"}
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "alpha" and chat.choices[0].message.content is not None
    server.wait_idle()


def test_models_lists_the_base_and_the_adapters(server, model_dir):
    models = {m.id: m for m in server.client().models.list().data}
    assert list(models) == ["tiny", "alpha", "beta"]
    assert models["alpha"].model_extra["parent"] == "tiny" and models["beta"].model_extra["parent"] == "tiny"
    assert models["beta"].model_extra["root"] == str(model_dir / "beta")


def test_an_unknown_model_is_a_404(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gamma' does not exist" in error["message"] and "'alpha'" in error["message"]
    chat = {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10)
    assert response.status_code == 404
    assert server.client().completions.create(model="alpha", prompt="hi", max_tokens=2).model == "alpha"


def test_lora_options_are_checked_before_any_model_loads():
    from hfaccel.tools.cli import build_parser, main
    from hfaccel.tools.serving import lora_adapters

    def parse(*options):
        return build_parser().parse_args(["serve", "base", *options])

    assert lora_adapters(parse()) is None
    assert lora_adapters(parse("--lora", "a=/x", "--lora", "b = /y")) == {"a": "/x", "b": "/y"}
    for options, message in (
        (("--lora", "a"), "NAME=PATH"),
        (("--lora", "a=/x", "--lora", "a=/y"), "given twice"),
        (("--served-model-name", "m", "--lora", "m=/x"), "the served model's own name"),
    ):
        with pytest.raises(SystemExit, match=message):
            lora_adapters(parse(*options))
    with pytest.raises(SystemExit, match="--lora is not supported with tensor parallelism"):
        main(["serve", "base", "--lora", "a=/x", "--tensor-parallel-size", "2"])
