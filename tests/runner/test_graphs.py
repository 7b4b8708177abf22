"""The runner's decode mode compiled with torch.compile (inductor on the CPU): equal to the eager static step at
every batch size, with one graph for all sizes."""

import pytest
import torch

from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool
from hfaccel.runner import ModelRunner
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
