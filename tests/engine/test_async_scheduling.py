"""Asynchronous scheduling: each step is launched before the host reads the previous step's tokens, and the
outputs are exactly those of synchronous scheduling — greedy and seeded sampling, stops that end a sequence
while its next token is in flight, n > 1, logprobs, penalties, preemption, chunked prefill, aborts.

On the CPU the device work is synchronous, so these tests check the bookkeeping (pending tokens read from
the previous step's tensor, dropped tokens past a stop, deferred prefix registration), not the overlap.
"""

import pytest
import torch

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.sampling import SampledTokens
from hfaccel.engine.scheduler import PENDING
from tests.devices import DEVICE
from tests.models import char_tokenizer, tiny_model

PROMPTS = ["the cat", "hello there", "x", "a longer prompt than the others", "the cat sat", "0123456789"]
CONFIGS = {
    "roomy": {"num_blocks": 96, "block_size": 4},
    "tight": {"num_blocks": 12, "block_size": 4, "max_num_batched_tokens": 7},  # preemption + chunked prefill
}


@pytest.fixture(scope="module")
def model():
    return hfaccel.accelerate(tiny_model("llama"), attention="torch")


def engine(model, async_scheduling: bool, **kwargs) -> Engine:
    return Engine(model, char_tokenizer(), max_num_seqs=6, async_scheduling=async_scheduling, **kwargs)


def workload(model) -> list[SamplingParams]:
    """One SamplingParams per prompt covering every option; stops chosen from a free run so that they end
    sequences mid-generation (the next token is then already in flight)."""
    free = engine(model, False).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens = [out.outputs[0].token_ids for out in free]
    text = [out.outputs[0].text for out in free]
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[tokens[0][4]]),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[text[1][3:6]], logprobs=2),
        SamplingParams(max_tokens=1, temperature=0.8, seed=3),
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=4, n=3, ignore_eos=True),
        SamplingParams(
            max_tokens=9,
            temperature=0,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.4,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=11, temperature=0.7, min_p=0.05, seed=5, repetition_penalty=1.2, n=2, logprobs=1, ignore_eos=True
        ),
    ]


def summary(outputs):
    return [
        [
            (
                o.token_ids,
                o.text,
                o.finish_reason,
                o.stop_reason,
                None if o.logprobs is None else [(p.token_id, round(p.logprob, 5), sorted(p.top)) for p in o.logprobs],
            )
            for o in out.outputs
        ]
        for out in outputs
    ]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_outputs_equal_synchronous_scheduling(model, config):
    params = workload(model)
    sync = engine(model, False, **CONFIGS[config])
    overlapped = engine(model, True, **CONFIGS[config])
    expected = summary(sync.generate(PROMPTS, params))
    assert summary(overlapped.generate(PROMPTS, params)) == expected
    assert expected[0][0][2:4] == ("stop", params[0].stop_token_ids[0]) and expected[1][0][2] == "stop"
    assert overlapped.stats()["blocks_used"] == 0 and not overlapped.executor.in_flight


def test_each_step_is_launched_before_the_previous_tokens_are_read(model, monkeypatch):
    events = []
    result = SampledTokens.result
    monkeypatch.setattr(SampledTokens, "result", lambda self: events.append("read") or result(self))
    for async_scheduling in (False, True):
        events.clear()
        e = engine(model, async_scheduling, cuda_graphs=False)  # every forward through runner.forward
        forward = e.runner.forward
        e.runner.forward = lambda *args, **kwargs: events.append("launch") or forward(*args, **kwargs)
        e.generate("abc", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        if async_scheduling:  # the prompt's step is read at once; then launch 3 before reading 2, ..., read 6
            assert events == ["launch", "read", "launch"] + ["launch", "read"] * 4 + ["read"]
        else:
            assert events == ["launch", "read"] * 6
        # max_tokens is known ahead: no forward runs past the last token


def test_a_stop_drops_the_token_in_flight(model):
    params = workload(model)[0]
    e = engine(model, True)
    request_id = e.add_request(PROMPTS[0], params)
    while e.has_unfinished_requests():
        e.step()
    out = e.snapshot(e.requests[request_id]).outputs[0]
    seq = e.requests[request_id].seqs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == params.stop_token_ids[0]
    assert seq.token_ids[len(seq.request.prompt_token_ids) :] == out.token_ids  # nothing past the stop
    assert seq.num_pending == 0 and e.stats()["blocks_used"] == 0 and not e.executor.in_flight


def test_abort_while_a_token_is_in_flight(model):
    e = engine(model, True, num_blocks=32, block_size=4)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    keep, drop = e.add_request("keep going", greedy), e.add_request("stop me", greedy)
    for _ in range(4):
        e.step()
    assert e.requests[drop].seqs[0].num_pending == 1
    assert e.abort(drop)
    aborted = e.snapshot(e.requests[drop]).outputs[0]
    assert aborted.finish_reason == "abort" and PENDING not in e.requests[drop].seqs[0].token_ids
    blocks = e.stats()["blocks_used"]
    e.step()  # the aborted request's token in flight is dropped
    assert e.snapshot(e.requests[drop]).outputs[0].token_ids == aborted.token_ids
    assert e.stats()["blocks_used"] <= blocks
    while e.has_unfinished_requests():
        e.step()
    alone = engine(model, False).generate("keep going", greedy)[0].outputs[0].token_ids
    assert e.snapshot(e.requests[keep]).outputs[0].token_ids == alone
    assert e.stats()["blocks_used"] == 0


def test_step_reports_the_previous_steps_tokens(model):
    """A step with prefill work reads its own tokens (the next admissions see them); in the decode steady state a
    step reports the tokens of the step before it."""
    e = engine(model, True)
    request_id = e.add_request("abc", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = e.step()  # the prompt's step
    assert [len(out.outputs[0].token_ids) for out in first] == [1] and first[0].request_id == request_id
    assert e.step() == []  # decode: launched, its token not read yet
    assert [len(out.outputs[0].token_ids) for out in e.step()] == [2]


def test_steps_with_prefill_work_do_not_overlap(model):
    """Overlap only in the decode steady state: while a request waits or a prompt is being computed, each step
    reads its tokens before the next is scheduled."""
    events = []
    e = engine(model, True, cuda_graphs=False, max_num_batched_tokens=4)  # a 9-token prompt runs in 3 chunks
    forward, collect = e.runner.forward, e._collect_all_but
    e.runner.forward = lambda *args, **kwargs: events.append("launch") or forward(*args, **kwargs)
    e._collect_all_but = lambda keep, touched: (
        events.append(f"in flight {len(e.executor.in_flight)}, keep {keep}") or collect(keep, touched)
    )
    e.add_request("123456789", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert events == ["in flight 0, keep 0", "launch", "in flight 1, keep 0"] * 3


def test_generated_blocks_are_cached_for_a_follow_up(model):
    """Blocks of generated tokens (filled in a step after they were scheduled) are registered with their real
    tokens: a follow-up whose prompt is the first prompt + its output hits them, and its output is exact."""
    greedy = SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)
    results = {}
    for async_scheduling in (False, True):
        e = engine(model, async_scheduling, num_blocks=64, block_size=4)
        first = e.generate([5, 6, 7, 8, 9, 10], greedy)[0]
        follow_up = e.generate([5, 6, 7, 8, 9, 10] + first.outputs[0].token_ids, greedy)[0]
        results[async_scheduling] = (
            first.outputs[0].token_ids,
            follow_up.outputs[0].token_ids,
            follow_up.metrics.num_cached_tokens,
        )
    assert results[True] == results[False]
    assert results[True][2] == 20  # the 23 computed tokens of the first request: 5 full blocks


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host-device synchronization exists only on a GPU")
def test_decode_steps_never_block_on_the_device(model):
    """In the decode steady state (CUDA graphs, asynchronous scheduling) nothing in a step synchronizes with
    the device except waiting for the previous step's tokens (an event, which sync debug mode allows)."""
    e = engine(model, True)
    for prompt in PROMPTS[:4]:
        e.add_request(
            prompt,
            SamplingParams(
                max_tokens=40, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True, repetition_penalty=1.1, logprobs=2
            ),
        )
    for _ in range(6):  # prompts in, a graph captured for batch 4
        e.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            e.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_interrupted_wait_is_retried(model, monkeypatch, async_scheduling):
    """Ctrl-C (or an error surfacing from the device) while the host waits for a step's tokens: the step stays
    queued, the next ``step()`` collects it, and the outputs are those of an uninterrupted run."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    expected = [out.outputs[0].token_ids for out in engine(model, False).generate(prompts, greedy)]
    e = engine(model, async_scheduling, num_blocks=40, block_size=4)
    ids = [e.add_request(prompt, greedy) for prompt in prompts]
    e.step()
    e.step()
    result = SampledTokens.result
    monkeypatch.setattr(SampledTokens, "result", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        e.step()
    monkeypatch.setattr(SampledTokens, "result", result)
    while e.has_unfinished_requests():
        e.step()
    assert [e.snapshot(e.requests[i]).outputs[0].token_ids for i in ids] == expected
    assert e.stats()["blocks_used"] == 0 and not e.executor.in_flight
