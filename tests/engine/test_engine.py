"""The continuous-batching engine gives each prompt exactly what its own ``model.generate`` gives (greedy), under
preemption, prefix caching and chunked prefill; stop conditions, n > 1, logprobs, seeds, streaming, aborts.

Most cases run hfaccel's torch reference kernels (fast on the CPU); ``test_exactness_through_triton_kernels``
runs the interpreted Triton kernels.
"""

import pytest
import torch

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from tests.devices import DEVICE
from tests.helpers import greedy, mixed_prompts, reference, run
from tests.models import ARCHITECTURES, char_tokenizer, family_model, tiny_model, wide_head_model

CONFIGS = {
    "default": {},
    "preemption": {"num_blocks": 16, "block_size": 4},  # 64 slots for 20 prompts: sequences get preempted
    "chunked-prefill": {"max_num_batched_tokens": 5},
    "no-prefix-cache": {"enable_prefix_caching": False, "num_blocks": 16, "block_size": 4, "max_num_batched_tokens": 9},
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_exactness_under_each_scheduling_condition(config, async_scheduling):
    model = tiny_model("llama")
    prompts, budgets = mixed_prompts()
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"),
        max_num_seqs=8,
        async_scheduling=async_scheduling,
        **CONFIGS[config],
    )
    outputs = run(engine, prompts, budgets)
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.outputs[0].token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) differs under {config}"
        assert out.outputs[0].finish_reason == "length"
    preemptions = sum(out.metrics.num_preemptions for out in outputs)
    cached = sum(out.metrics.num_cached_tokens for out in outputs)
    if config == "preemption":
        assert preemptions > 0, "the tiny pool should have forced preemption"
    if config == "no-prefix-cache":
        assert cached == 0
    if config == "default":
        assert cached > 0, "prompts sharing a 20-token prefix should hit the prefix cache"
    assert engine.stats()["blocks_used"] == 0 and engine.requests == {}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_exactness_across_architectures(arch, async_scheduling):
    """Preemption, chunked prefill and prefix caching at once, on every architecture."""
    model = tiny_model(arch)
    prompts, budgets = mixed_prompts(12, seed=1)
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"),
        max_num_seqs=6,
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=11,
        async_scheduling=async_scheduling,
    )
    for i, (out, want) in enumerate(zip(run(engine, prompts, budgets), expected)):
        assert out.outputs[0].token_ids == want, f"{arch}: prompt {i} differs"
    assert engine.stats()["blocks_used"] == 0


def test_exactness_through_triton_kernels():
    model = tiny_model("qwen2")
    prompts, budgets = mixed_prompts(6, seed=2)
    budgets = [min(b, 8) for b in budgets]
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention="triton"),
        max_num_seqs=4,
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=16,
    )
    for out, want in zip(run(engine, prompts, budgets), expected):
        assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_repetition_penalty_matches_transformers(async_scheduling):
    model = tiny_model("mistral")
    prompts, _ = mixed_prompts(4, seed=3)
    expected = [
        model.generate(
            torch.tensor([p], device=model.device),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = Engine(hfaccel.accelerate(model, attention="torch"), max_num_seqs=4, async_scheduling=async_scheduling)
    outputs = engine.generate(prompts, greedy(12, repetition_penalty=1.5))
    assert [out.outputs[0].token_ids for out in outputs] == expected


# ------------------------------------------------------------------------------------- stopping & text
@pytest.fixture(scope="module")
def char_engine():
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    return Engine(model, char_tokenizer(), max_num_seqs=8, num_blocks=64, block_size=4)


def test_stop_strings_spanning_tokens_are_cut_from_the_text(char_engine):
    free = char_engine.generate("the cat", greedy(30))[0].outputs[0]
    assert len(free.text) == 30  # one character per token
    stop = free.text[12:15]  # three tokens long, inside the output
    first = free.text.find(stop)
    out = char_engine.generate("the cat", greedy(30, stop=["zzzz", stop]))[0].outputs[0]
    assert out.text == free.text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free.token_ids[: first + len(stop)]  # through the token that completed the stop


def test_stop_token_and_eos(char_engine):
    free = char_engine.generate("hello", greedy(20))[0].outputs[0]
    stop_id = free.token_ids[5]
    out = char_engine.generate("hello", greedy(20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == free.text[: free.token_ids.index(stop_id)]  # the stop token's text is not output


def test_max_tokens_1_and_text_equals_decode(char_engine):
    out = char_engine.generate(["abc", "x"], greedy(1))
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 1]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    long = char_engine.generate("abc", greedy(17))[0].outputs[0]
    assert long.text == char_engine.tokenizer.decode(long.token_ids)


def test_bad_prompts_fail_alone(char_engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        char_engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="context is 256"):
        char_engine.add_request([5] * 300, greedy(4))
    with pytest.raises(ValueError, match="token ids must be in \\[0, 96\\)"):
        char_engine.add_request([5, 500], greedy(4))
    with pytest.raises(ValueError, match="SamplingParams.temperature must be"):
        SamplingParams(temperature=-1)
    outputs = char_engine.generate(["good", [5] * 300, "", "also good"], greedy(5))
    assert [o.error is None for o in outputs] == [True, False, False, True]
    assert "context is 256" in outputs[1].error and outputs[2].outputs[0].finish_reason == "error"
    assert [len(o.outputs[0].token_ids) for o in (outputs[0], outputs[3])] == [5, 5]
    assert char_engine.stats()["blocks_used"] == 0


# ---------------------------------------------------------------------------------- n, seeds, logprobs
def test_n_completions_share_the_prompt():
    model = tiny_model("qwen3")
    prompt = list(range(3, 30))
    expected = reference(model, [prompt], [10])[0]
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"), max_num_seqs=8, num_blocks=32, block_size=4, cuda_graphs=False
    )  # every forward through runner.forward, to count its tokens
    computed, forward = [], engine.runner.forward
    engine.runner.forward = lambda ids, tokens, *a, **k: computed.append(len(tokens)) or forward(ids, tokens, *a, **k)
    out = engine.generate(prompt, greedy(10, n=3))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == expected for o in out.outputs)
    assert sum(computed) == len(prompt) + 3 * 9, "the siblings share the prompt's computation, not only its blocks"
    sampled = engine.generate(prompt, SamplingParams(max_tokens=10, n=3, seed=5, ignore_eos=True))[0]
    again = engine.generate(prompt, SamplingParams(max_tokens=10, n=3, seed=5, ignore_eos=True))[0]
    assert [o.token_ids for o in sampled.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1  # each completion samples on its own
    assert engine.stats()["blocks_used"] == 0


def test_seeded_request_does_not_depend_on_the_batch():
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    alone = Engine(model, max_num_seqs=8).generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    others, budgets = mixed_prompts(7, seed=4)
    crowd = Engine(model, max_num_seqs=8, max_num_batched_tokens=13)
    mixed = [SamplingParams(max_tokens=b, temperature=1.0, ignore_eos=True) for b in budgets]
    outputs = crowd.generate(others[:3] + [[5, 6, 7, 8]] + others[3:], mixed[:3] + [params] + mixed[3:])
    assert outputs[3].outputs[0].token_ids == alone


def test_logprobs_are_the_models():
    model = tiny_model("phi3")
    prompt = [4, 9, 16, 25, 36]
    engine = Engine(hfaccel.accelerate(model, attention="torch"), max_num_seqs=2)
    out = engine.generate(prompt, greedy(4, logprobs=3))[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids], device=model.device)).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).cpu()
    for step, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[step]
        assert entry.logprob == pytest.approx(expected[step, entry.token_id].item(), abs=1e-4)
        top = expected[step].topk(3)
        assert list(entry.top) == top.indices.tolist()  # greedy: the chosen token is the top one
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


# ------------------------------------------------------------------------------------- stream & abort
def test_stream_deltas_add_up_and_closing_aborts(char_engine):
    full = char_engine.generate("stream me", greedy(12))[0].outputs[0]
    deltas = list(char_engine.stream("stream me", greedy(12)))
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == full.text
    assert sum((d.outputs[0].token_ids for d in deltas if d.outputs), []) == full.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    stream = char_engine.stream("abort me", greedy(50))
    next(stream)
    next(stream)
    assert char_engine.stats()["blocks_used"] > 0
    stream.close()  # the consumer goes away: the request is aborted, its blocks freed
    assert char_engine.stats()["blocks_used"] == 0 and char_engine.requests == {}


def test_abort_frees_blocks_at_once():
    engine = Engine(
        hfaccel.accelerate(tiny_model("llama"), attention="torch"), max_num_seqs=4, num_blocks=32, block_size=4
    )
    ids = [engine.add_request(list(range(3, 20)), greedy(30)) for _ in range(3)]
    engine.step()
    engine.step()
    used = engine.stats()["blocks_used"]
    assert engine.abort(ids[1]) and not engine.abort(ids[1]) and not engine.abort("nope")
    assert engine.stats()["blocks_used"] < used
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.snapshot(engine.requests[ids[1]]).outputs[0].finish_reason == "abort"
    assert engine.stats()["blocks_used"] == 0


def test_model_hfaccel_cannot_serve_is_refused():
    model = wide_head_model()
    original = model.config._attn_implementation
    with pytest.raises(ValueError, match="Engine cannot serve LlamaForCausalLM: .*head_dim 640"):
        Engine(model)
    assert model.config._attn_implementation == original  # left as it was


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_static_shape_decode_steps_are_exact(attention):
    """The CUDA-graph decode path (static buffers, padded batch sizes; run without capture on the CPU; block tables
    as wide as the pool): padding rows write nowhere and change nothing. With the torch kernels, asynchronous
    scheduling too (each decode token copied into the static input buffer from the previous step's device tensor)."""
    model = tiny_model("gemma2" if attention == "torch" else "llama")
    prompts, _ = mixed_prompts(9, seed=5)
    budgets = [3 + i for i in range(9)]  # sequences finish one by one: decode batches of every size
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention=attention),
        max_num_seqs=7,
        num_blocks=60,
        block_size=4,
        cuda_graphs=True,
        async_scheduling=attention == "torch",
    )
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 7]
    assert engine.runner.graphs.capture == (DEVICE.type == "cuda")  # captured and replayed on a GPU
    # tables as wide as the pool holds, not the model's whole context: no sequence outgrows the pool
    assert engine.max_model_len > 60 * 4 and engine.runner.graphs.buffers.block_tables.shape == (7, 60)
    served, replay = [], engine.runner.graphs.run
    engine.runner.graphs.run = lambda seq_ids, *args: served.append(len(seq_ids)) or replay(seq_ids, *args)
    for out, want in zip(run(engine, prompts, budgets), expected):
        assert out.outputs[0].token_ids == want
    assert set(served) - {1, 2, 4, 7}, f"some decode step should have been padded to a ladder size: {served}"


def test_seeded_requests_keep_the_decode_graphs_and_draw_inside_them():
    """Seeded sampling draws no generator state: decode steps with seeded requests in the batch still take the
    static-shape (CUDA-graph) path — captured on a GPU — and draw their tokens inside it (greedy neighbours
    included), the eager path's tokens; a step with a row that needs its logits (logprobs) samples them as before."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    prompts, _ = mixed_prompts(7, seed=7)
    params = [
        SamplingParams(max_tokens=6 + i, temperature=0.9, top_p=0.9, top_k=9 * i, seed=100 + i, ignore_eos=True)
        for i in range(5)
    ]
    params += [
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.2, seed=3, logprobs=2, ignore_eos=True),
    ]
    settings = dict(max_num_seqs=8, num_blocks=60, block_size=4)
    eager = Engine(model, cuda_graphs=False, **settings).generate(prompts, params)
    engine = Engine(model, cuda_graphs=True, **settings)
    served, replay = [], engine.runner.graphs.run
    engine.runner.graphs.run = lambda seq_ids, *args, **kwargs: (
        served.append((len(seq_ids), "draw" in kwargs)) or replay(seq_ids, *args, **kwargs)
    )
    graphed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert len(graphed[-1].outputs[0].logprobs) == 5
    drawn = [drew for _, drew in served]
    assert any(drawn) and not all(drawn)  # drawn inside the step once the logprobs request finished
    assert engine.runner.graphs.capture == (DEVICE.type == "cuda")  # still capturing on a GPU
    assert not engine.runner.graphs.capture_failures, engine.runner.graphs.status()


def test_a_draw_that_cannot_be_compiled_runs_uncompiled_and_keeps_the_compiled_step(monkeypatch):
    """torch.compile failing on the in-step draw costs the draw its compile, not the model's step, and not the call:
    the tokens are the uncompiled engine's, stats() says why."""
    from torch._dynamo.exc import Unsupported

    from hfaccel.runner import graphs as graphs_module
    from hfaccel.sampling import draw_step

    compile = graphs_module.torch.compile

    def draw_uncompilable(function, **kwargs):
        if function.__code__.co_name != draw_step.__name__:
            return compile(function, **kwargs)

        def compiled(*args):
            raise Unsupported("the draw cannot be traced")

        return compiled

    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    prompts, _ = mixed_prompts(3, seed=4)
    params = [SamplingParams(max_tokens=4, temperature=1.2, seed=i, ignore_eos=True) for i in range(3)]
    settings = dict(max_num_seqs=4, num_blocks=40, block_size=4, cuda_graphs=True)
    expected = [o.outputs[0].token_ids for o in Engine(model, compile=False, **settings).generate(prompts, params)]
    monkeypatch.setattr(graphs_module.torch, "compile", draw_uncompilable)
    engine = Engine(model, compile=True, **settings)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == expected
    status = engine.stats()["decode_steps"]
    assert status.startswith("compiled") and "draw uncompiled (Unsupported: the draw cannot be traced)" in status


def test_a_one_token_prompt_chunk_beside_sampled_decodes_is_not_drawn_in_the_step():
    """A step of one-token chunks where one is a prompt's first chunk (the token budget left it one token) is no
    decode step: its logits come back for the completing rows and the rest waits — the step does not fail."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    settings = dict(max_num_seqs=4, max_num_batched_tokens=4, num_blocks=60, block_size=4)
    sampled = [SamplingParams(max_tokens=6, temperature=1.1, seed=i, ignore_eos=True) for i in range(3)]
    late = SamplingParams(max_tokens=3, temperature=0.7, seed=9, ignore_eos=True)
    outputs = {}
    for cuda_graphs in (False, True):
        engine = Engine(model, cuda_graphs=cuda_graphs, async_scheduling=False, **settings)
        for i, params in enumerate(sampled):
            engine.add_request([5 + i], params, request_id=f"r{i}")
        engine.step()  # three one-token prompts: the budget's last token stays free
        engine.add_request(list(range(3, 12)), late, request_id="late")  # its first chunk: one token
        done = {}
        while engine.has_unfinished_requests():
            done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
        outputs[cuda_graphs] = done
    assert outputs[True] == outputs[False] and len(outputs[True]) == 4


def test_a_request_id_used_again_computes_its_prompt_logprobs_again():
    """A request asking for prompt logprobs computes its prompt (its blocks are keyed by that request alone): one
    given the same id after the first was released computes each prompt logprob again, from no prefix-cache hit."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    engine = Engine(model, max_num_seqs=2, num_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outputs = []
    for _ in range(2):
        engine.add_request(list(range(3, 20)), params, request_id="again")
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
        engine.release("again")
    first, second = ([entry.logprob for entry in out.prompt_logprobs[1:]] for out in outputs)
    assert second == first and len(first) == 16 and outputs[1].metrics.num_cached_tokens == 0


@pytest.mark.slow
def test_the_engine_compiles_its_decode_steps_when_it_is_built():
    """Engine(compile=True) compiles (and on a GPU captures) every ladder size while it is built, so the first
    request — and a server's first request — waits for none of it: serving compiles nothing more, and stats()
    says how the steps run."""
    from torch._dynamo.utils import counters

    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    prompts, _ = mixed_prompts(6, seed=3)
    budgets = [2 + i for i in range(6)]
    expected = reference(model, prompts, budgets)
    before = counters["stats"]["unique_graphs"]
    engine = Engine(model, max_num_seqs=6, num_blocks=60, block_size=4, cuda_graphs=True, compile=True)
    built = counters["stats"]["unique_graphs"]
    assert built - before == 2  # one graph for every size, batch 1 included; one for the draw
    assert [out.outputs[0].token_ids for out in run(engine, prompts, budgets)] == expected
    seeded = [SamplingParams(max_tokens=5, temperature=1.3, top_p=0.9, seed=i, ignore_eos=True) for i in range(6)]
    uncompiled = Engine(model, max_num_seqs=6, num_blocks=60, block_size=4, cuda_graphs=True, compile=False)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, seeded)] == [
        o.outputs[0].token_ids for o in uncompiled.generate(prompts, seeded)
    ]  # the compiled draw's tokens
    assert counters["stats"]["unique_graphs"] == built
    assert engine.stats()["decode_steps"].startswith("compiled")


def test_n_beyond_max_num_seqs_and_any_seed():
    engine = Engine(
        hfaccel.accelerate(tiny_model("llama"), attention="torch"), max_num_seqs=2, num_blocks=32, block_size=4
    )
    with pytest.raises(ValueError, match="n=3 completions cannot run at once"):
        engine.add_request([5, 6], SamplingParams(n=3))
    out = engine.generate([5, 6], SamplingParams(max_tokens=3, n=2, seed=2**64 - 1, ignore_eos=True))[0]
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
    negative = engine.generate([5, 6], SamplingParams(max_tokens=3, seed=-7, ignore_eos=True))[0]
    assert len(negative.outputs[0].token_ids) == 3


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_next"])
def test_a_failed_step_changes_nothing(monkeypatch, hybrid):
    """If sampling fails (e.g. out of memory) the step does not count: the next one recomputes it (a hybrid model's
    sequences from their tokens: the forward already advanced their recurrent state, which cannot be written twice)."""
    import hfaccel.engine.executor as executor_module

    model = family_model("qwen3_next") if hybrid else tiny_model("llama")
    prompts, budgets = mixed_prompts(3, seed=6)
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"),
        max_num_seqs=4,
        num_blocks=40,
        block_size=4,
        async_scheduling=False,
    )
    ids = [engine.add_request(p, greedy(b)) for p, b in zip(prompts, budgets)]
    engine.step()
    engine.step()
    real = executor_module.sample
    monkeypatch.setattr(executor_module, "sample", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    monkeypatch.setattr(executor_module, "sample", real)
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.snapshot(engine.requests[i]).outputs[0].token_ids for i in ids] == expected
    if hybrid:
        assert engine.stats()["state_slots_free"] == 4
