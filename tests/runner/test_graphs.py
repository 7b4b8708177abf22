"""The runner's decode mode compiled with torch.compile (inductor on the CPU): equal to the eager static step at
every batch size, with one graph for all sizes."""

import contextlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import transformers

from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool
from hfaccel.runner import ModelRunner
from tests.devices import DEVICE
from tests.models import tiny_model

SIZES = list(range(1, 12))  # more batch sizes than dynamo's recompile limit (8): one graph must serve them all


def _decode_logits(model, compile: bool) -> list[torch.Tensor]:
    """Prefill 11 sequences, then host-fed decode steps of 1, 2, ..., 11 of them; the logits of each step (the
    eager steps never captured: the reference)."""
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=64, block_size=4))
    runner.enable_decode_graphs(len(SIZES), 64, compile=compile, ladder=SIZES, capture=None if compile else False)
    gen = torch.Generator().manual_seed(3)
    lengths = [3 + (5 * i) % 9 for i in SIZES]
    prompt = torch.randint(3, 96, (sum(lengths),), generator=gen)
    runner.forward(SIZES, prompt.to(model.device), lengths)
    steps = []
    for size in SIZES:
        tokens = torch.randint(3, 96, (size,), generator=gen).to(model.device)
        steps.append(runner.forward(SIZES[:size], tokens, [1] * size))
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_decode_mode_equals_eager_at_every_batch_size(arch):
    model = tiny_model(arch)
    with hfaccel_attention(model, "torch"):
        expected = _decode_logits(model, compile=False)
        got = _decode_logits(model, compile=True)
        again = _decode_logits(model, compile=True)  # another runner compiles its own copy of the step
    for want, have, have_again in zip(expected, got, again):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(have_again, want, atol=1e-5, rtol=1e-5)


def _rope_frequencies(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers < 5.19's RoPE: frequencies from a transposed matmul, concatenated with themselves."""
    freqs = (inv_freq[None, :, None] @ positions[None, None, :].float()).transpose(1, 2)  # [1, T, D/2]
    return torch.cat((freqs, freqs), dim=-1).cos()  # [1, T, D]


def test_the_steps_backend_serves_one_token_and_many_with_one_graph():
    """Inductor's rewrite of a cat that repeats one tensor guards on a size of 1; the decode step's backend gives the
    repeats aliases of their own, so a step traced at one token serves two (and back) without compiling again, with
    inductor's results."""
    from torch._dynamo.utils import counters

    from hfaccel import compat

    compiled = torch.compile(_rope_frequencies, fullgraph=True, dynamic=None, backend=compat.inductor_backend)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # [4]
    before = counters["stats"]["unique_graphs"]
    for tokens in (1, 2, 7, 1):
        positions = torch.arange(3, 3 + tokens)
        torch._dynamo.mark_dynamic(positions, 0)
        with compat.marked_sizes_only():
            got = compiled(positions, inv_freq)
        torch.testing.assert_close(got, _rope_frequencies(positions, inv_freq), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_fallback_reason_leads_with_the_error_that_started_it():
    """A failed capture surfaces as capture_end's "previous error during capture"; the reason recorded names the
    error raised inside the captured step first."""
    from hfaccel.runner.step_function import failure_reason

    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
        except RuntimeError:
            raise ValueError("operation failed due to a previous error during capture")
    except ValueError as error:
        reason = failure_reason(error)
    assert reason == (
        "RuntimeError: CUDA error: operation not permitted when stream is capturing; then "
        "ValueError: operation failed due to a previous error during capture"
    )
    assert failure_reason(KeyError("size")) == "KeyError: 'size'"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_a_failed_capture_runs_that_size_eagerly_and_leaves_random_ops_working(monkeypatch):
    """A step that cannot be captured (here: it reads a value on the host while capturing) runs eagerly with the
    cause as its reason; the device's generator leaves capture mode (torch leaves it there after a failed capture,
    and every later random op failed), and the next size still captures."""
    from hfaccel.runner import graphs

    real = graphs.static_step

    def reads_on_the_host_while_capturing(runner, rows, *args):
        logits = real(runner, rows, *args)
        if torch.cuda.is_current_stream_capturing() and rows[2].shape[0] == 2:
            logits.sum().item()
        return logits

    monkeypatch.setattr(graphs, "static_step", reads_on_the_host_while_capturing)
    model = tiny_model("llama")
    with hfaccel_attention(model, "torch"):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=64, block_size=4))
        runner.enable_decode_graphs(4, 64, ladder=[2, 4])
        runner.forward([0, 1, 2], torch.tensor([5, 6, 7], device=DEVICE), [1, 1, 1])
        runner.forward([0, 1], torch.tensor([8, 9], device=DEVICE), [1, 1])
        runner.forward([0, 1, 2], torch.tensor([10, 11, 12], device=DEVICE), [1, 1, 1])
    (size, *_), reason = next(iter(runner.graphs.capture_failures.items()))
    assert size == 2 and "stream is capturing" in reason.split("; then")[0], reason  # the cause, first
    assert len(runner.graphs.capture_failures) == 1 and runner.graphs._graphs  # size 4 captured
    torch.multinomial(torch.softmax(torch.randn(3, 11, device=DEVICE), -1), 1)  # raised after a failed capture


def _steps_of_one(model, compile: bool, replays: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One sequence's prompt, then four host-fed decode steps on the static steps (ladder 1, 2, 4) and four device-fed
    ones; the logits of each. ``replays`` collects each replay's whole output, padding rows included."""
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=32, block_size=4, max_num_seqs=2))
    graphs = runner.enable_decode_graphs(4, 64, compile=compile, ladder=[1, 2, 4], capture=None if compile else False)
    if replays is not None:
        replay = graphs._replay
        graphs._replay = lambda *args, **kwargs: replays.append(out := replay(*args, **kwargs)) or out
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 96, (17,), generator=gen).to(DEVICE)
    steps = [runner.forward([0], tokens[:9], [9])]
    for i in range(9, 13):
        steps.append(runner.forward([0], tokens[i : i + 1], [1]))
    runner.pool.manager.append(0, 4)  # slots for the device-fed steps
    graphs.begin([0], [13])
    steps += [graphs.advance(tokens[i : i + 1]).clone() for i in range(13, 17)]
    return steps


def _moe_model(name: str) -> transformers.PreTrainedModel:
    """The smallest stack of a mixture-of-experts family with each of its layer kinds, quick to compile: Gemma 4's
    text model with its MoE block on (sliding and global layers, the last two reading the first two's K/V), or
    Qwen3.5-MoE (one recurrent, one attention layer)."""
    from tests.hf.tiny_configs import tiny_config
    from tests.models import FAMILIES, gemma4_config

    if name == "gemma4_moe":
        config = gemma4_config()
        config.enable_moe_block, config.num_experts, config.top_k_experts, config.moe_intermediate_size = True, 4, 2, 32
        config.num_hidden_layers, config.layer_types = 4, ["sliding_attention", "full_attention"] * 2
    else:
        model_type, overrides = FAMILIES[name]
        layers = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
        config = tiny_config(model_type, **{**overrides, **layers})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma4_moe", "qwen3_5_moe"])
def test_one_sequence_padded_on_experts_is_mirrored_by_its_padding_row(name):
    """Where a model's code specialises a compiled step of one sequence, that step runs padded to two; on a mixture of
    experts (Gemma 4's MoE block, Qwen3.5-MoE's beside recurrent layers) the padding row repeats the sequence — its
    keys and state read, nothing written — so it routes to the sequence's experts (its logits are the sequence's)
    instead of reading other experts' weights. The sequence's logits equal the eager steps', host-fed and device-fed,
    K/V and state intact."""
    model = _moe_model(name)
    with hfaccel_attention(model, "torch"), torch.inference_mode():
        expected = _steps_of_one(model, compile=False)
        replays: list[torch.Tensor] = []
        got = _steps_of_one(model, compile=True, replays=replays)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    decode = [out for out in replays if out.shape[0] == 2]
    assert len(decode) == 8, [out.shape for out in replays]  # every decode step ran at size 2
    for out in decode:
        torch.testing.assert_close(out[1], out[0], atol=1e-6, rtol=1e-6)


def test_padding_rows_mirror_only_where_experts_are_routed():
    """Which models' padded steps of one sequence mirror it: those whose expert banks read only the experts their
    tokens are routed to (transformers' experts interface). A mirror row reads the sequence's K/V again, which only
    pays where it spares other experts' weights: not on a dense model, nor on Llama 4, whose experts all run on
    every token."""
    from hfaccel.runner.graphs import routed_expert_banks
    from tests.hf.tiny_configs import tiny_config
    from tests.models import FAMILIES, family_served, gemma4_config

    def routed(config) -> bool:
        return bool(routed_expert_banks(transformers.AutoModelForCausalLM.from_config(config)))

    families = {name: model_type for name, (model_type, _) in FAMILIES.items() if family_served(name)}
    moe = {name for name, model_type in families.items() if routed(tiny_config(model_type))}
    hybrid_moe = {"qwen3_next", "qwen3_5_moe", "granite_h", "jamba", "minimax", "kimi_linear", "zaya"}
    latent_moe = {"deepseek_v3", "deepseek_v32", "glm_moe_dsa", "dots3_note"}
    assert moe == (hybrid_moe | latent_moe | {"gpt_oss"}) & set(families)
    assert routed(_moe_model("gemma4_moe").config) and not routed(gemma4_config()) and not routed(tiny_config("llama"))
    assert not routed(tiny_config("granitemoehybrid", num_local_experts=0))


class _RecordedGraph:
    """``torch.cuda.CUDAGraph`` as capturing behaves, on the CPU: a capture records the step without its effects
    (whatever it wrote is put back), and each replay runs the recorded step again into the captured output."""

    recording: "_RecordedGraph | None" = None

    def __init__(self):
        self.step, self.out = None, None

    def replay(self) -> None:
        self.out.copy_(self.step())

    def pool(self) -> None:
        return None


def _capture_on_the_cpu(monkeypatch, graphs, state: Callable[[], list[torch.Tensor]]) -> None:
    """Make ``graphs`` capture its steps as :class:`_RecordedGraph` records them; ``state``: every tensor a step
    writes (what a capture leaves as it found)."""
    step = graphs._step

    def recorded(*args):
        out = step(*args)
        if _RecordedGraph.recording is not None:
            _RecordedGraph.recording.step, _RecordedGraph.recording.out = (lambda: step(*args)), out
        return out

    @contextlib.contextmanager
    def capture(graph, pool=None):
        saved = [tensor.clone() for tensor in state()]
        _RecordedGraph.recording = graph
        try:
            yield
        finally:
            _RecordedGraph.recording = None
            for tensor, before in zip(state(), saved):
                tensor.copy_(before)

    no_stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(graphs, "_step", recorded)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: no_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: no_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


def _decode_steps(model, capture: bool, monkeypatch=None) -> list[torch.Tensor]:
    """Three sequences' prompts, then decode steps of the three (size 4) and of one (size 1 or 2), host-fed and
    device-fed; with ``capture``, every size captured the first time it runs (on the CPU as
    :func:`_capture_on_the_cpu` stands in for CUDA graphs)."""
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=48, block_size=4, max_num_seqs=4))
    graphs = runner.enable_decode_graphs(4, 64, capture=capture, ladder=[1, 2, 4])
    if capture and DEVICE.type != "cuda":
        pool = runner.pool
        buffers = graphs.buffers

        def state() -> list[torch.Tensor]:
            states = pool.states.tensors() if pool.states is not None else []
            return [*pool.tensors, *states, buffers.input_ids, *buffers._padded()]

        _capture_on_the_cpu(monkeypatch, graphs, state)
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, 96, (24,), generator=gen).to(DEVICE)
    steps = [runner.forward([0, 1, 2], prompts, [9, 8, 7])]
    for _ in range(3):  # a captured step's logits are its graph's output, which the next replay overwrites: cloned
        steps.append(runner.forward([0, 1, 2], torch.randint(3, 96, (3,), generator=gen).to(DEVICE), [1, 1, 1]).clone())
    for _ in range(3):
        steps.append(runner.forward([1], torch.randint(3, 96, (1,), generator=gen).to(DEVICE), [1]).clone())
    for seq in (0, 1, 2):
        runner.pool.manager.append(seq, 3)  # slots for the device-fed steps
    graphs.begin([0, 1, 2], [12, 14, 10])
    steps += [graphs.advance(torch.randint(3, 96, (3,), generator=gen).to(DEVICE)).clone() for _ in range(3)]
    return steps


@pytest.mark.parametrize("name", ["qwen3_next", "llama4"])
def test_a_captured_step_runs_its_rows_once(name, monkeypatch):
    """Capturing a size compiles it in a first run, then records it, then replays it: that first run is made on
    padding rows, so the rows' step runs once — a recurrent state (Qwen3-Next's) and a device-fed step's positions
    move on by one step, not two — and every step equals the uncaptured one (real CUDA graphs on a GPU; on the CPU
    :class:`_RecordedGraph` records and replays as they do)."""
    from tests.models import family_model

    model = family_model(name)
    with hfaccel_attention(model, "torch"), torch.inference_mode():
        expected = _decode_steps(model, capture=False)
        got = _decode_steps(model, capture=True, monkeypatch=monkeypatch)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)


def test_steps_for_a_model_stating_no_context_are_built_for_a_bucket():
    """Compiled or captured steps are built for the model's whole context (``max_position_embeddings``), so that
    nothing compiles again; for a model stating none (Mamba-2), for ``OPEN_CONTEXT_BUCKET`` tokens, then each power of
    two above, so that a longer ``generate()`` call builds them again only past those. Uncompiled, uncaptured steps:
    the power of two holding the context."""
    from hfaccel.runner.graphs import MIN_CONTEXT_BUCKET, OPEN_CONTEXT_BUCKET, context_bucket
    from tests.models import family_model

    llama, mamba = tiny_model("llama"), family_model("mamba2")
    assert context_bucket(100, whole=True, model=llama) == llama.config.max_position_embeddings
    assert context_bucket(3, whole=True, model=mamba) == OPEN_CONTEXT_BUCKET
    assert context_bucket(OPEN_CONTEXT_BUCKET, whole=True, model=mamba) == OPEN_CONTEXT_BUCKET
    assert context_bucket(OPEN_CONTEXT_BUCKET + 1, whole=True, model=mamba) == 2 * OPEN_CONTEXT_BUCKET
    assert context_bucket(100, whole=False, model=mamba) == 128
    assert context_bucket(3, whole=False, model=llama) == MIN_CONTEXT_BUCKET
