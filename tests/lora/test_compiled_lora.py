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


@pytest.mark.slow
def test_the_compiled_step_serves_adapters_on_a_hybrid_models_mixers(tmp_path):
    """Falcon-H1's Mamba-2 mixers run inside the compiled step on its rows plus a scratch row (``hfaccel.kv.state``):
    adapters on their projections give PEFT's tokens beside the base model's, the step compiled."""
    import re

    from torch import nn

    from hfaccel.kv import model_layout
    from tests.models import family_model

    base = family_model("falcon_h1").cpu()
    mixers = tuple(f"{mixer}." for mixer in model_layout(base).mixers.values())
    layers = [n for n, m in base.named_modules() if type(m) is nn.Linear and n.startswith(mixers)]
    targets = "|".join(re.escape(n) for n in layers if not n.endswith(".out_proj"))  # PEFT refuses Mamba's out_proj
    prompts = [[p % 90 + 3 for p in prompt] for prompt in PROMPTS[:2]]
    peft = save_adapter(base, tmp_path / "mixers", r=4, seed=1, target_modules=targets)
    expected = greedy_tokens(peft, prompts) + greedy_tokens(base, prompts)
    engine = Engine(
        hfaccel.accelerate(base, attention="torch"),
        lora_adapters={"mixers": tmp_path / "mixers"},
        max_num_seqs=4,
        num_blocks=64,
        cuda_graphs=True,
        compile=True,
    )
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    try:
        outs = engine.generate(prompts * 2, greedy, lora=["mixers", "mixers", None, None])
        assert [out.outputs[0].token_ids for out in outs] == expected
        assert engine.stats()["decode_steps"].startswith("compiled")
    finally:
        engine.close()
