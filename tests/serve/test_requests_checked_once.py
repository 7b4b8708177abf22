"""The server checks and tokenizes each prompt once, off its event loop (a long prompt never stalls the other
streams), and the engine queues what was checked without checking it again. In-process, over ASGI."""

import asyncio
import threading

import httpx
import pytest

import hfaccel
from hfaccel import AsyncEngine, Engine
from hfaccel.serve.server import ServerConfig, create_app
from tests.models import char_tokenizer, tiny_model


@pytest.fixture
def counted():
    """An AsyncEngine whose engine records the thread of every tokenization and counts every check."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    engine = Engine(model, char_tokenizer(), max_num_seqs=4, num_blocks=64, block_size=4)
    calls = {"tokenize": [], "check_params": 0}
    tokenize, check = engine.intake.tokenize, engine.intake.check_params

    def counting_tokenize(prompt):
        calls["tokenize"].append(threading.get_ident())
        return tokenize(prompt)

    def counting_check(params):
        calls["check_params"] += 1
        return check(params)

    engine.intake.tokenize, engine.intake.check_params = counting_tokenize, counting_check
    async_engine = AsyncEngine(engine)
    yield async_engine, calls
    async_engine.shutdown()


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json=body, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_is_checked_and_tokenized_once_off_the_event_loop(counted, stream):
    async_engine, calls = counted
    app = create_app(async_engine, ServerConfig(model_name="tiny"))

    async def scenario():
        loop_thread = threading.get_ident()
        reply = await _post(
            app,
            "/v1/completions",
            {"model": "tiny", "prompt": ["the cat", "a dog"], "max_tokens": 3, "temperature": 0, "stream": stream},
        )
        return loop_thread, reply

    loop_thread, reply = asyncio.run(scenario())
    assert reply.status_code == 200, reply.text
    assert len(calls["tokenize"]) == 2 and loop_thread not in calls["tokenize"]
    assert calls["check_params"] == 2


def test_a_bad_request_is_refused_by_that_one_check(counted):
    async_engine, calls = counted
    app = create_app(async_engine, ServerConfig(model_name="tiny"))
    reply = asyncio.run(
        _post(app, "/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 3, "top_k": 10_000})
    )
    assert reply.status_code == 400 and "top_k" in reply.text
    assert calls["check_params"] == 1


def test_a_prepared_prompt_carries_its_params(counted):
    async_engine, calls = counted

    async def scenario():
        prepared = await async_engine.prepare("the cat", hfaccel.SamplingParams(max_tokens=2, temperature=0))
        with pytest.raises(ValueError, match="carries its own SamplingParams"):
            async for _ in async_engine.stream(prepared, hfaccel.SamplingParams()):
                pass
        return await async_engine.generate(prepared)

    out = asyncio.run(scenario())
    assert len(out.outputs[0].token_ids) == 2 and calls["check_params"] == 1 and len(calls["tokenize"]) == 1
