"""AsyncEngine: concurrent streams from asyncio tasks, cancellation frees blocks, bad requests fail alone."""

import asyncio
import time

import pytest

import hfaccel
from hfaccel import AsyncEngine, Engine, SamplingParams
from tests.models import char_tokenizer, tiny_model

PROMPTS = ["the cat", "hello there", "x", "a longer prompt than the others"]


@pytest.fixture
def engines():
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    make = lambda: Engine(model, char_tokenizer(), max_num_seqs=4, num_blocks=64, block_size=4)  # noqa: E731
    async_engine = AsyncEngine(make())
    yield make(), async_engine
    async_engine.shutdown()


def _greedy(n=10):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _collect(engine, prompt, params):
    text, tokens, last = "", [], None
    async for delta in engine.stream(prompt, params):
        for out in delta.outputs:
            text, tokens = text + out.text, tokens + out.token_ids
        last = delta
    return text, tokens, last


def test_concurrent_streams_equal_the_sync_engine(engines):
    sync, async_engine = engines
    expected = sync.generate(PROMPTS, _greedy())

    async def main():
        return await asyncio.gather(*(_collect(async_engine, p, _greedy()) for p in PROMPTS))

    results = asyncio.run(main())
    for (text, tokens, last), want in zip(results, expected):
        assert (text, tokens) == (want.outputs[0].text, want.outputs[0].token_ids)
        assert last.finished and last.outputs[0].finish_reason == "length"
    full = asyncio.run(async_engine.generate("the cat", _greedy()))
    assert full.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert async_engine.stats()["blocks_used"] == 0


def test_cancelled_stream_aborts_and_frees_blocks(engines):
    _, async_engine = engines

    async def main():
        stream = async_engine.stream("abort me", _greedy(200))
        await stream.__anext__()
        assert async_engine.stats()["blocks_used"] > 0
        await stream.aclose()  # what a web framework does when the client disconnects

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while async_engine.stats()["blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_engine.stats()["blocks_used"] == 0 and async_engine.stats()["running"] == 0


def test_bad_request_fails_alone(engines):
    _, async_engine = engines

    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await async_engine.generate("", _greedy())
        return await async_engine.generate("still fine", _greedy(3))

    assert len(asyncio.run(main()).outputs[0].token_ids) == 3


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_goes_on(engines):
    _, async_engine = engines
    real_step, calls = async_engine.engine.step_requests, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_step()

    async_engine.engine.step_requests = failing_once

    async def main():
        with pytest.raises(RuntimeError, match="out of memory"):
            await async_engine.generate("first", _greedy())
        return await async_engine.generate("second", _greedy(4))

    assert len(asyncio.run(main()).outputs[0].token_ids) == 4
    assert async_engine.healthy and async_engine.stats()["blocks_used"] == 0
