"""One bad request never hurts another: sampling parameters are checked against the model before a request
joins a batch, and a request whose part of a step fails anyway (its forward, its sampling, its
detokenization) is failed alone while the others go on, token for token as if it had never been there."""

import asyncio

import pytest
import torch

import hfaccel
from hfaccel.engine import AsyncEngine, DeviceLostError, Engine, InvalidSamplingParams, SamplingParams
from tests.models import char_tokenizer, tiny_model

PROMPTS = ["the cat", "hello there", "x", "a longer prompt than the others"]


@pytest.fixture(scope="module")
def model():
    return hfaccel.accelerate(tiny_model("llama"), attention="torch")


def make_engine(model, async_scheduling: bool = False, max_num_seqs: int = 8) -> Engine:
    return Engine(
        model,
        char_tokenizer(),
        max_num_seqs=max_num_seqs,
        num_blocks=64,
        block_size=4,
        async_scheduling=async_scheduling,
    )


def greedy(budget: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


BEYOND_THE_MODEL = [
    ({"top_k": 97}, "top_k", "SamplingParams.top_k must be None, -1 or 0 (off), or an int in [1, 96]"),
    ({"stop_token_ids": [5, 96]}, "stop_token_ids", "token ids in [0, 96) (the vocabulary)"),
    ({"n": 9}, "n", "n=9 completions cannot run at once"),
]


@pytest.mark.parametrize("bad, param, message", BEYOND_THE_MODEL, ids=[case[1] for case in BEYOND_THE_MODEL])
def test_parameters_beyond_the_model_fail_alone(model, bad, param, message):
    engine = make_engine(model)
    with pytest.raises(InvalidSamplingParams, match="top_k") as raised:
        SamplingParams(top_k=2**70)  # no int64 holds it: refused before any engine sees it
    assert raised.value.param == "top_k"
    expected = tokens(engine.generate(PROMPTS, greedy()))
    outputs = engine.generate(["bad"] + PROMPTS, [SamplingParams(**bad)] + [greedy()] * len(PROMPTS))
    assert outputs[0].outputs[0].finish_reason == "error" and message in outputs[0].error
    assert tokens(outputs[1:]) == expected
    assert tokens(engine.generate(PROMPTS, greedy())) == expected  # and the engine goes on
    with pytest.raises(InvalidSamplingParams) as raised:
        engine.check_params(SamplingParams(**bad))
    assert raised.value.param == param
    assert engine.stats()["blocks_used"] == 0 and engine.requests == {}


def test_text_that_is_not_unicode_is_a_clear_error(model):
    engine = make_engine(model)
    with pytest.raises(
        ValueError, match="the prompt is not valid Unicode text: surrogates not allowed '\\\\ud800' at character 1"
    ):
        engine.add_request("a\ud800b", greedy())
    with pytest.raises(ValueError, match="message 0's 'content' is not valid Unicode"):
        engine.add_request([{"role": "user", "content": "a\udfffb"}], greedy())
    assert engine.requests == {}


def _poison_forward(engine: Engine, request_id: str) -> None:
    """Every forward that computes a token of ``request_id`` raises (as a kernel error in its rows would)."""
    forward = engine.runner.forward

    def failing(seq_ids, *args, **kwargs):
        request = engine.requests.get(request_id)
        if request is not None and {s.seq_id for s in request.seqs} & set(seq_ids):
            raise RuntimeError("a kernel refused this request's rows (simulated)")
        return forward(seq_ids, *args, **kwargs)

    engine.runner.forward = failing


class _BrokenTokenizer:
    def decode(self, ids, **kwargs):
        raise RuntimeError("the tokenizer cannot decode this (simulated)")


def _poison(engine: Engine, where: str, request_id: str) -> str:
    """Make ``request_id``'s part of the next step fail in ``where``; returns the error its output gets."""
    request = engine.requests[request_id]
    if where == "forward":
        _poison_forward(engine, request_id)
        return "refused this request's rows"
    if where == "sampling":  # changed after it was checked: more top logprobs than the vocabulary has
        request.params.logprobs = 1000
        return "RuntimeError"
    request.seqs[0].detokenizer.tokenizer = _BrokenTokenizer()
    return "cannot decode"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["forward", "sampling", "detokenizing"])
def test_a_request_whose_step_fails_fails_alone(model, where, async_scheduling):
    engine = make_engine(model, async_scheduling)
    expected = engine.generate(PROMPTS, greedy())
    bad = engine.add_request("poison", greedy(30, n=2))
    message = _poison(engine, where, bad)
    outputs = engine.generate(PROMPTS, greedy())  # steps the bad request too: it shares their batches
    failed = engine.snapshot(engine.requests[bad])
    assert failed.finished and message in failed.error
    assert [o.finish_reason for o in failed.outputs] == ["error"] * len(failed.outputs)
    assert tokens(outputs) == tokens(expected)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    engine.release(bad)
    assert engine.stats()["blocks_used"] == 0 and engine.requests == {}
    if where == "forward":
        del engine.runner.forward  # the runner's own again
    assert tokens(engine.generate(PROMPTS, greedy())) == tokens(expected)


def test_a_failure_of_the_whole_step_leaves_the_engine_serving(model, monkeypatch):
    """Every request fails alike (out of memory): generate() raises, takes its requests out, the next works."""
    import hfaccel.engine.executor as executor_module

    engine = make_engine(model)
    expected = tokens(engine.generate(PROMPTS, greedy()))
    real = executor_module.sample
    monkeypatch.setattr(executor_module, "sample", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(PROMPTS, greedy())
    assert engine.requests == {} and engine.stats()["blocks_used"] == 0
    monkeypatch.setattr(executor_module, "sample", real)
    assert tokens(engine.generate(PROMPTS, greedy())) == expected


@pytest.mark.parametrize("max_num_seqs", [8, 1], ids=["batched", "alone-in-its-step"])
def test_async_engine_fails_the_request_alone_and_streams_the_others(model, max_num_seqs):
    """Batched with the others, the bad request is singled out; alone in its step (max_num_seqs=1: the others
    wait), the step fails as a whole, which fails the requests it ran and not those waiting."""
    sync = make_engine(model)
    expected = tokens(sync.generate(PROMPTS, greedy(40)))
    async_engine = AsyncEngine(make_engine(model, max_num_seqs=max_num_seqs))
    _poison_forward(async_engine.engine, "poison")

    async def collect(prompt, request_id=None):
        ids = []
        async for delta in async_engine.stream(prompt, greedy(40), request_id):
            ids += delta.outputs[0].token_ids if delta.outputs else []
        return ids

    async def main():
        return await asyncio.gather(collect("poison", "poison"), *(collect(p) for p in PROMPTS), return_exceptions=True)

    try:
        failed, *streams = asyncio.run(main())
        # failed alone: RequestFailed; or, stepped before the others arrived, with its step's own error
        assert isinstance(failed, RuntimeError) and "refused this request's rows" in str(failed)
        assert streams == expected
        assert async_engine.healthy and async_engine.stats()["blocks_used"] == 0
        assert asyncio.run(async_engine.generate("after", greedy(3))).outputs[0].finish_reason == "length"
    finally:
        async_engine.shutdown()


def test_a_device_error_ends_the_engine_only_when_the_device_keeps_it(model, monkeypatch):
    """A step raises a device error (``torch.AcceleratorError``) for every request. While the device still runs work
    (out of memory, a bad launch), the step's error is raised and the engine serves the next call; once it fails
    every call (a CUDA error that sticks to its context), :class:`DeviceLostError` is raised from it: nothing more
    can run in the process. Either way ``generate()`` takes its requests out."""
    import hfaccel.device as device_module

    engine = make_engine(model)
    expected = tokens(engine.generate(PROMPTS, greedy()))
    forward = engine.runner.forward
    error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered (simulated)")
    engine.runner.forward = _forward_raising(error)
    with pytest.raises(torch.AcceleratorError) as recovered:
        engine.generate(PROMPTS, greedy())
    assert recovered.value is error and engine.requests == {} and engine.stats()["blocks_used"] == 0
    monkeypatch.setattr(device_module, "device_works", lambda device: False)
    with pytest.raises(DeviceLostError, match="restart it") as lost:
        engine.generate(PROMPTS, greedy())
    assert lost.value.__cause__ is error and engine.requests == {} and engine.stats()["blocks_used"] == 0
    monkeypatch.undo()
    engine.runner.forward = forward
    assert tokens(engine.generate(PROMPTS, greedy())) == expected
    lost_engine = make_engine(model)  # a lost device fails generate()'s clean-up too: its error is still the one seen
    lost_engine.runner.forward = _forward_raising(error)
    monkeypatch.setattr(device_module, "device_works", lambda device: False)
    monkeypatch.setattr(lost_engine, "abort", _failing_clean_up)
    with pytest.raises(DeviceLostError):
        lost_engine.generate(PROMPTS, greedy())


@pytest.mark.parametrize("ending", ["TensorParallelError", "DeviceLostError"])
def test_an_error_no_handler_may_take_ends_the_engine_thread_and_tells_on_failure(model, monkeypatch, ending):
    """A ``TensorParallelError`` (the TP ranks diverged) or a ``DeviceLostError`` (a device error the device keeps) is
    not a request's error: the step's handlers let it through, the thread ends, every stream in flight gets a
    RuntimeError naming it, ``healthy`` turns False and ``on_failure`` hears of it once (``hfaccel serve`` then
    exits, and a TP leader's launcher stops every rank); later requests are refused."""
    import hfaccel.device as device_module
    from hfaccel.distributed import TensorParallelError

    ended = []
    async_engine = AsyncEngine(make_engine(model), on_failure=ended.append)
    forward = async_engine.engine.runner.forward
    if ending == "TensorParallelError":
        error = TensorParallelError("a multimodal prefill raised on 1 of 2 TP ranks (simulated)")
    else:  # as Triton's launcher raises it; the lost device then fails the aborts of the clean-up too
        error = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered (simulated)")
        monkeypatch.setattr(device_module, "device_works", lambda device: False)
        monkeypatch.setattr(async_engine.engine, "abort", _failing_clean_up)

    def failing(seq_ids, *args, **kwargs):
        if async_engine.engine.requests.get("third") is not None:
            raise error
        return forward(seq_ids, *args, **kwargs)

    async_engine.engine.runner.forward = failing

    async def main():
        first = await async_engine.generate("the cat", greedy(3))
        streams = [async_engine.generate(p, greedy(3), request_id) for p, request_id in [("x", "third"), ("hi", "4")]]
        return first, await asyncio.gather(*streams, return_exceptions=True)

    try:
        first, failed = asyncio.run(main())
        assert first.outputs[0].finish_reason == "length"
        async_engine._thread.join(30)  # on_failure is called once the streams have their error
        (end,) = ended
        assert type(end).__name__ == ending and (end is error or end.__cause__ is error)
        for stream_error in failed:
            assert isinstance(stream_error, RuntimeError) and stream_error.__cause__ is end, stream_error
            assert f"the engine thread failed: {ending}" in str(stream_error)
        assert not async_engine.healthy
        with pytest.raises(RuntimeError, match=f"the engine thread failed: {ending}"):
            asyncio.run(async_engine.generate("after", greedy(3)))
    finally:
        async_engine.shutdown()


def _forward_raising(error: Exception):
    def forward(*args, **kwargs):
        raise error

    return forward


def _failing_clean_up(request_id: str) -> bool:
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (simulated, in an abort)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA context that keeps an error needs a GPU")
def test_a_device_side_assert_loses_the_cuda_device_and_out_of_memory_does_not():
    """On a GPU, in a process of its own (its CUDA context is lost for good): out of memory leaves the device working;
    an out-of-bounds index (a device-side assert) makes every later call fail, which ``raise_if_lost`` tells."""
    import subprocess
    import sys

    code = """
import torch
from hfaccel.device import DeviceLostError, device_works, raise_if_lost
x = torch.zeros(3, device="cuda")
try:
    torch.empty(1 << 50, device="cuda")
except torch.OutOfMemoryError as error:
    raise_if_lost(error, x.device)
assert device_works(x.device)
try:
    x[torch.tensor([7], device="cuda")] = 1.0
    torch.cuda.synchronize()
except torch.AcceleratorError as error:
    try:
        raise_if_lost(error, x.device)
    except DeviceLostError:
        print("lost")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "lost", done.stderr[-3000:]
