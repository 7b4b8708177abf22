"""The runner's decode mode compiled with torch.compile (inductor on the CPU): equal to the eager static step at
every batch size, with one graph for all sizes."""

import pytest
import torch

from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool
from hfaccel.runner import ModelRunner
from tests.devices import DEVICE
from tests.models import tiny_model

SIZES = list(range(1, 12))  # more batch sizes than dynamo's recompile limit (8): one graph must serve them all


def _decode_logits(model, compile: bool) -> list[torch.Tensor]:
    """Prefill 11 sequences, then host-fed decode steps of 1, 2, ..., 11 of them; the logits of each step."""
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=64, block_size=4))
    runner.enable_decode_graphs(len(SIZES), 64, compile=compile, ladder=SIZES)
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
