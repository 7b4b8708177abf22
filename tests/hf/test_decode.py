"""hfaccel's decode loop behind generate(): transformers' tokens (and random-generator state), no padding held,
static decode steps that never wait for the device, compiled steps equal to eager ones.

Models run the torch reference kernels (the loop is what is under test; the kernels have their own tests) except
where a test says otherwise.
"""

import contextlib
from collections.abc import Iterator
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import hfaccel
from hfaccel import compat
from hfaccel.runner.graphs import MIN_CONTEXT_BUCKET
import hfaccel.hf.decode as decode
import hfaccel.runner.graphs as graphs
from tests.devices import DEVICE
from tests.models import char_tokenizer, generate_cache, model_cache, padded_batch, tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0)


def _pair(arch: str = "llama", **accelerate_kwargs):
    model = tiny_model(arch)
    return model, lambda: hfaccel.accelerate(model, attention="torch", **accelerate_kwargs)


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_rows_stopping_at_different_steps_give_transformers_tokens(monkeypatch, defer):
    """EOS ends rows at different steps; finished rows are padded; the loop ends when the last row ends. With the
    stop check deferred (how CUDA runs it) the step computed past the end is undone."""
    monkeypatch.setattr(decode, "defers_stop_checks", lambda device: defer)
    model, accelerate = _pair()
    batch = padded_batch(seed=2)
    eos = _token_every_row_makes_at_different_steps(model, batch, 30)
    kwargs = dict(max_new_tokens=30, eos_token_id=eos, **GREEDY)
    expected = model.generate(**batch, **kwargs)
    accelerate()
    got = model.generate(**batch, **kwargs)
    assert torch.equal(got, expected) and got.shape[1] < batch["input_ids"].shape[1] + 30
    assert str(model.hfaccel.decode) == "hfaccel"


def _token_every_row_makes_at_different_steps(model, batch: dict, steps: int) -> int:
    """A token each row's greedy continuation contains, first made at different steps (an EOS that ends the rows at
    different steps, all before the budget)."""
    made = model.generate(**batch, max_new_tokens=steps, eos_token_id=None, **GREEDY)[:, batch["input_ids"].shape[1] :]
    for token in made[0].tolist():
        firsts = [row.tolist().index(token) for row in made if token in row.tolist()]
        if len(firsts) == len(made) and len(set(firsts)) > 1:
            return token
    raise AssertionError("the probe found no token every row makes at different steps; choose another batch")


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_sampling_draws_the_same_tokens_and_leaves_the_generator_as_transformers_does(monkeypatch, defer):
    monkeypatch.setattr(decode, "defers_stop_checks", lambda device: defer)
    model, accelerate = _pair("qwen2")
    batch = padded_batch()
    kwargs = dict(max_new_tokens=20, do_sample=True, top_p=0.9, temperature=0.7, pad_token_id=0, eos_token_id=7)
    torch.manual_seed(5)
    expected = model.generate(**batch, **kwargs)
    expected_state = torch.get_rng_state()
    accelerate()
    torch.manual_seed(5)
    got = model.generate(**batch, **kwargs)
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), expected_state)  # an undone step's draws are put back


def test_processors_criteria_and_streamer_are_transformers_own():
    """Repetition penalty, min_new_tokens, bad words, a stop string, several return sequences and a streamer:
    all through the loop, as transformers' loop gives them."""
    model, accelerate = _pair("mistral")
    batch = padded_batch()

    class Collect:
        def __init__(self):
            self.parts = []

        def put(self, value):
            self.parts.append(value.tolist())

        def end(self):
            self.parts.append("end")

    kwargs = dict(
        max_new_tokens=9,
        min_new_tokens=4,
        repetition_penalty=1.3,
        bad_words_ids=[[5], [6, 7]],
        num_return_sequences=2,
        do_sample=True,
        top_k=8,
        pad_token_id=0,
        eos_token_id=3,
    )
    torch.manual_seed(2)
    expected_stream = Collect()
    expected = model.generate(**batch, streamer=None, **kwargs)
    accelerate()
    torch.manual_seed(2)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    hfaccel.restore(model)
    prompt = batch["input_ids"][:1, -4:]
    model.generate(prompt, max_new_tokens=5, streamer=expected_stream, **GREEDY)
    accelerate()
    stream = Collect()
    model.generate(prompt, max_new_tokens=5, streamer=stream, **GREEDY)
    assert stream.parts == expected_stream.parts and str(model.hfaccel.decode) == "hfaccel"


def test_stop_strings_need_the_tokenizer_generate_was_given():
    """transformers hands a callable custom_generate neither the tokenizer nor the streamer; stop strings still end
    rows where transformers' loop ends them, and without a tokenizer the call fails as transformers' does."""
    model, accelerate = _pair("qwen3")
    batch, tokenizer = padded_batch(), char_tokenizer()
    probe = model.generate(**batch, max_new_tokens=20, eos_token_id=None, **GREEDY)
    stop = tokenizer.decode(probe[0, -14:-12])  # two characters row 0 makes after 6 tokens: a string across tokens
    kwargs = dict(max_new_tokens=20, eos_token_id=None, stop_strings=[stop], **GREEDY)
    expected = model.generate(**batch, tokenizer=tokenizer, **kwargs)
    accelerate()
    got = model.generate(**batch, tokenizer=tokenizer, **kwargs)
    assert torch.equal(got, expected) and str(model.hfaccel.decode) == "hfaccel"
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(**batch, **kwargs)


def test_what_the_loop_leaves_to_transformers_says_why():
    model, accelerate = _pair()
    accelerate()
    batch = padded_batch()
    model.generate(**batch, max_new_tokens=2, return_dict_in_generate=True, **GREEDY)
    assert str(model.hfaccel.decode) == "transformers (generation options ['return_dict_in_generate'])"
    holes = batch["attention_mask"].clone()
    holes[0, -3] = 0
    model.generate(batch["input_ids"], attention_mask=holes, max_new_tokens=2, **GREEDY)
    assert str(model.hfaccel.decode) == "transformers (an attention mask that is not left padding)"
    model.generate(**batch, max_new_tokens=2, **generate_cache(DynamicCache(config=model.config)), **GREEDY)
    assert str(model.hfaccel.decode) == "transformers (the caller's cache)"
    model.generate(**batch, max_new_tokens=2, **GREEDY)
    assert str(model.hfaccel.decode) == "hfaccel"


def test_a_fallback_of_the_whole_loop_is_logged_once_per_model_and_reason(caplog):
    model, accelerate = _pair()
    accelerate()
    batch = padded_batch()
    with caplog.at_level("WARNING", logger="hfaccel"):
        for _ in range(2):
            model.generate(**batch, max_new_tokens=2, num_beams=2, **GREEDY)
        model.generate(**batch, max_new_tokens=2, **GREEDY)
    logged = [r.getMessage() for r in caplog.records if "transformers' decoding loop" in r.getMessage()]
    assert len(logged) == 1 and "num_beams" in logged[0] and "LlamaForCausalLM" in logged[0], logged


@pytest.mark.parametrize(
    "name", ("cache", "past_key_values") if compat.generate_cache_argument() == "cache" else ("past_key_values",)
)
def test_a_paged_cache_the_caller_passes_is_used_under_either_name(name):
    """``cache=`` (transformers >= 5.24) and ``past_key_values=`` (every version) both hand generate() the caller's
    PagedCache, which transformers' loop then fills."""
    model, accelerate = _pair()
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=6, **GREEDY)
    accelerate()
    cache = hfaccel.PagedCache(model.config, max_batch_size=3, max_cache_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is the caller's choice here
        got = model.generate(**batch, max_new_tokens=6, **{name: cache}, **GREEDY)
    assert torch.equal(got, expected)
    assert cache.memory_stats()["blocks_used"] > 0
    assert str(model.hfaccel.decode) == "transformers (the caller's cache)"


def test_hfaccels_own_calls_raise_no_deprecation_warnings():
    """The decode loop, the runner's forwards and the PagedCache hfaccel gives transformers' loop pass the cache under
    the name the installed transformers takes (``cache`` from 5.24), so no FutureWarning comes from hfaccel."""
    model, accelerate = _pair()
    accelerate()
    batch = padded_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(**batch, max_new_tokens=3, **GREEDY)
        assert str(model.hfaccel.decode) == "hfaccel"
        model.generate(**batch, max_new_tokens=3, num_beams=2, **GREEDY)
        assert "num_beams" in str(model.hfaccel.decode)


def test_left_padding_takes_no_kv_memory():
    """Rows of 11, 7 and 4 real tokens in a batch padded to 11: the pool holds 22 prompt tokens, not 33."""
    model, accelerate = _pair()
    accelerate()
    batch = padded_batch((11, 7, 4))
    held = []
    real_forward = hfaccel.runner.ModelRunner.forward

    def watch(runner, seq_ids, input_ids, num_new, **kwargs):
        held.append(sum(num_new))
        return real_forward(runner, seq_ids, input_ids, num_new, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hfaccel.runner.ModelRunner, "forward", watch)
        model.generate(**batch, max_new_tokens=3, **GREEDY)
    assert held == [22]  # the prefill computed (and stored) the real tokens only; decode steps are static
    pool = model.hfaccel.session.runner.pool
    assert pool.manager.num_used_blocks == 0  # every block is back after the call


class _FailOnHostReads(TorchDispatchMode):
    """Fails on any op that makes the host wait for a tensor's value, and on the Tensor methods that read one
    without an op the mode sees (``tolist``, ``numpy``: on a CPU tensor they read its memory directly, so a step
    calling them would pass on the CPU and wait for the device on CUDA). ``item()``, ``bool()``, ``int()`` reach
    the mode as ``aten._local_scalar_dense``."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero")
    METHODS = ("tolist", "numpy")

    def __enter__(self) -> "_FailOnHostReads":
        self._methods = _failing_tensor_methods(self.METHODS)
        self._methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._methods.__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.READS):
            raise AssertionError(f"the decode step reads a tensor's value on the host: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _failing_tensor_methods(names: tuple[str, ...]) -> Iterator[None]:
    """``torch.Tensor``'s methods ``names`` raise while the context runs (patched on the class, restored after)."""

    def failing(name: str):
        def method(tensor: torch.Tensor, *args, **kwargs):
            raise AssertionError(f"the decode step reads a tensor's value on the host: Tensor.{name}")

        return method

    with pytest.MonkeyPatch.context() as patch:
        for name in names:
            patch.setattr(torch.Tensor, name, failing(name))
        yield


def test_the_host_read_guard_catches_what_the_dispatcher_never_sees():
    """_FailOnHostReads fails on ``tolist``/``numpy`` of a CPU tensor (no op reaches a dispatch mode) as on
    ``item``/``bool``/``nonzero``, and leaves the methods as they were after it."""
    x = torch.tensor([1.0, 2.0])
    reads = (lambda: x.tolist(), lambda: x.numpy(), lambda: x[0].item(), lambda: bool(x[0]), lambda: x.nonzero())
    for read in reads:
        with pytest.raises(AssertionError, match="reads a tensor's value on the host"), _FailOnHostReads():
            read()
    assert x.tolist() == [1.0, 2.0] and x.numpy().tolist() == [1.0, 2.0]


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _watch_steps(monkeypatch, mode_factory) -> list:
    modes, real = [], graphs.DecodeGraphs._step

    def step(self, size, advance, *args):
        with mode_factory() as mode:
            modes.append(mode)
            return real(self, size, advance, *args)

    monkeypatch.setattr(graphs.DecodeGraphs, "_step", step)
    return modes


def test_a_decode_step_never_reads_a_tensor_on_the_host(monkeypatch):
    model, accelerate = _pair("gemma2")
    accelerate()
    modes = _watch_steps(monkeypatch, _FailOnHostReads)
    model.generate(**padded_batch(), max_new_tokens=4, **GREEDY)
    graphs_ = model.hfaccel.session.runner.graphs
    assert not graphs_.capture_failures, graphs_.status()
    # three decode steps: run one by one, or (CUDA) the first run once then captured, and the rest replayed
    assert len(modes) == (2 if graphs_.capture else 3)


def test_an_eager_decode_step_runs_no_more_ops_than_sdpa(monkeypatch):
    """Where compile cannot serve, the eager step is what users get: it must not cost more ops than transformers'
    sdpa decode forward with its DynamicCache."""
    model = tiny_model("llama")
    batch = padded_batch()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(**batch, **model_cache(model, cache), use_cache=True).logits
        mask = torch.cat([batch["attention_mask"], batch["attention_mask"].new_ones(3, 1)], 1)
        with _Count() as sdpa:
            model(
                input_ids=logits[:, -1].argmax(-1, keepdim=True),
                attention_mask=mask,
                position_ids=mask.cumsum(1)[:, -1:] - 1,
                **model_cache(model, cache),
                use_cache=True,
            )
    hfaccel.accelerate(model, attention="torch")
    modes = _watch_steps(monkeypatch, _Count)
    model.generate(**batch, max_new_tokens=4, **GREEDY)
    assert modes[-1].ops <= sdpa.ops, (modes[-1].ops, sdpa.ops)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_decode_steps_equal_eager_ones(arch):
    """accelerate(compile=True): the decode step compiled with torch.compile (fullgraph: any graph break fails),
    the same tokens as the eager step and as transformers."""
    model = tiny_model(arch)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=8, eos_token_id=None, **GREEDY)
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="torch", compile=True)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    assert model.hfaccel.session.runner.graphs.compiled and str(model.hfaccel.decode) == "hfaccel"


@pytest.mark.slow
def test_one_compiled_step_serves_every_batch_size_context_and_pool_size():
    """generate() at batch 1, 2, 3, 5, 9 and 17, a long prompt and a pool that has to grow: the decode step is
    compiled once per model — one graph for every size, batch 1 included, on every supported transformers — and
    neither a new batch size, a longer context nor a larger pool compiles
    again."""
    from torch._dynamo.utils import counters

    model, accelerate = _pair(compile=True)
    accelerate()
    before = counters["stats"]["unique_graphs"]
    for rows in (1, 2, 3, 5, 9, 17):
        model.generate(**padded_batch(tuple(4 + i % 5 for i in range(rows))), max_new_tokens=3, **GREEDY)
    blocks = model.hfaccel.session.runner.pool.num_blocks
    long_batch = padded_batch((150,) * 17)
    expected = _plain_generate(model, long_batch, max_new_tokens=3)
    got = model.generate(**long_batch, max_new_tokens=3, **GREEDY)
    assert torch.equal(got, expected) and str(model.hfaccel.decode) == "hfaccel"
    assert model.hfaccel.session.runner.pool.num_blocks > blocks  # the pool grew under the same step
    graphs = model.hfaccel.session.runner.graphs
    assert graphs.compiled and graphs.sizes[0] == 1, graphs.status()  # batch 1 on the graph itself, not padded
    assert counters["stats"]["unique_graphs"] - before == 1


def _plain_generate(model, batch: dict, **kwargs) -> torch.Tensor:
    """transformers' own tokens for an accelerated model (its attention kept, hfaccel's loop bypassed)."""
    return type(model).generate(model, **batch, **kwargs, **GREEDY)


def test_the_recompile_limit_falls_back_to_uncompiled_steps_with_its_reason(caplog):
    """Reaching dynamo's recompile limit (FailOnRecompileLimitHit under fullgraph) costs speed, not the call: the
    steps run uncompiled, and model.hfaccel says why."""
    model, accelerate = _pair(compile=True)
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=4, **GREEDY)
    accelerate()
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger="hfaccel"):
        model.generate(**{k: v[:1] for k, v in batch.items()}, max_new_tokens=2, **GREEDY)  # one graph: advance
        graphs = model.hfaccel.session.runner.graphs
        graphs.warm_up([1])  # the host-fed step (the Engine's) needs a second graph: past the limit
        got = model.generate(**batch, max_new_tokens=4, **GREEDY)
    assert torch.equal(got, expected) and str(model.hfaccel.decode) == "hfaccel"
    assert not graphs.compiled and "RecompileLimit" in graphs.compile_failure
    assert "uncompiled (" in str(model.hfaccel) and "FailOnRecompileLimitHit" in str(model.hfaccel)
    assert any("could not compile the decode step" in r.getMessage() for r in caplog.records)


def test_a_step_that_cannot_be_compiled_runs_uncompiled(monkeypatch, caplog):
    """torch.compile failing on the decode step (a model dynamo cannot trace) costs speed, not the call."""
    from torch._dynamo.exc import Unsupported

    model = tiny_model("llama")
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=5, **GREEDY)

    def uncompilable(function, **kwargs):
        def compiled(*args):
            raise Unsupported("a graph break in the model")

        return compiled

    monkeypatch.setattr(graphs.torch, "compile", uncompilable)
    hfaccel.accelerate(model, attention="torch", compile=True)
    with caplog.at_level("WARNING", logger="hfaccel"):
        assert torch.equal(model.generate(**batch, max_new_tokens=5, **GREEDY), expected)
    assert any("could not compile the decode step (Unsupported" in r.getMessage() for r in caplog.records)
    assert not model.hfaccel.session.runner.graphs.compiled and str(model.hfaccel.decode) == "hfaccel"
    assert "uncompiled (Unsupported: a graph break in the model)" in model.hfaccel.session.steps()


def test_a_call_while_another_runs_the_loop_takes_transformers_loop():
    """One model's decode loop serves one call at a time; a concurrent call runs transformers' loop, exactly."""
    import threading

    model, accelerate = _pair()
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=6, **GREEDY)
    accelerate()
    with model.hfaccel.session.lock:  # as if another thread's call were running the loop
        assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), expected)
    assert str(model.hfaccel.decode) == (
        "transformers (another generate() call on this model is running hfaccel's decode loop)"
    )
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.extend(model.generate(**batch, max_new_tokens=6, **GREEDY) for _ in range(3))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6 and all(torch.equal(got, expected) for got in results)


def test_one_set_of_decode_steps_serves_every_batch_and_restore_gives_the_memory_back():
    """The decode steps are made once per model (every ladder size; the model's context on a GPU, the smallest
    context bucket for these short calls on a CPU) and padded batches run the ladder's sizes: 3 rows run the step
    of 4."""
    model, accelerate = _pair()
    accelerate()
    steps, sizes = [], []
    for lengths in ((5,), (5, 4), (5, 4, 3), (5, 4, 3, 2)):
        model.generate(**padded_batch(lengths), max_new_tokens=2, **GREEDY)
        graphs = model.hfaccel.session.runner.graphs
        steps.append(graphs)
        sizes.append(graphs.size_for(len(lengths)))
    assert all(s is steps[0] for s in steps) and sizes == [1, 2, 4, 4]
    context = model.config.max_position_embeddings if DEVICE.type == "cuda" else MIN_CONTEXT_BUCKET
    assert steps[0].max_batch == 256 and steps[0].max_model_len == context
    runner = model.hfaccel.session.runner
    hfaccel.restore(model)
    assert not runner.pool.allocated and runner.graphs is None


def test_compile_argument_is_checked():
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'; got 'yes'"):
        hfaccel.accelerate(tiny_model("llama"), compile="yes")
    assert "compile='auto'" in str(hfaccel.accelerate(tiny_model("llama")).hfaccel)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host-device synchronization exists only on a GPU")
def test_steady_decode_steps_never_synchronize_on_cuda():
    model = tiny_model("llama")
    hfaccel.accelerate(model)
    batch = padded_batch()
    model.generate(**batch, max_new_tokens=4, **GREEDY)  # capture and warm up
    session = model.hfaccel.session
    real_advance = session.runner.graphs.advance

    def strict(input_ids):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_advance(input_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    session.runner.graphs.advance = strict
    model.generate(**batch, max_new_tokens=6, eos_token_id=None, **GREEDY)
