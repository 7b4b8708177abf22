"""The compiled decode step (``Engine(compile=True)``, what runs on a GPU, where it is also captured as CUDA graphs)
serves any mix of LoRA adapters exactly: the LoRA slot of each row reaches the kernels through a static buffer, and
the step of a batch without adapters is a variant of its own — both compiled while the engine is built, nothing
compiled while it serves."""

from __future__ import annotations

import pytest

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from tests.lora.adapters import NEW_TOKENS, PROMPTS, greedy_tokens, save_adapter
from tests.models import tiny_model


@pytest.mark.slow
def test_the_compiled_step_serves_mixed_adapters_exactly(tmp_path):
    from torch._dynamo.utils import counters

    base = tiny_model("llama")
    expected = {None: greedy_tokens(base, PROMPTS[:2])}
    paths = {}
    for seed, (name, r) in enumerate((("r8", 8), ("r16", 16)), 1):
        expected[name] = greedy_tokens(save_adapter(base, tmp_path / name, r=r, seed=seed), PROMPTS[:2])
        paths[name] = tmp_path / name
    model = hfaccel.accelerate(base, attention="torch")
    before = counters["stats"]["unique_graphs"]
    engine = Engine(
        model,
        lora_adapters=paths,
        max_lora_rank=16,
        max_num_seqs=2,
        num_blocks=64,
        block_size=4,
        cuda_graphs=True,
        compile=True,
    )
    built = counters["stats"]["unique_graphs"]
    assert built - before == 3  # one graph for every size without LoRA, one with, one for the draw
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for names in (["r8", "r16"], [None, "r8"], [None, None], ["r16", "r16"]):
        outs = engine.generate(PROMPTS[:2], greedy, lora=names)
        assert [out.outputs[0].token_ids for out in outs] == [expected[n][i] for i, n in enumerate(names)], names
    assert counters["stats"]["unique_graphs"] == built
    assert engine.stats()["decode_steps"].startswith("compiled")
    engine.close()
