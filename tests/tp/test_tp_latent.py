"""Multi-head latent attention under tensor parallelism (2 ranks over gloo): DeepSeek-V2's plan shards the attention
heads (``q_b_proj`` and ``kv_b_proj`` by columns, ``o_proj`` by rows) over a latent every rank holds whole;
DeepSeek-V3's leaves attention whole on every rank; DeepSeek-V3.2's shards the heads, its sparse attention's indexer
whole. Each rank reads its heads in the latent space (``hfaccel.kv.latent``; V3.2's the keys its indexer picks), and
``generate`` and the engine give the single process's tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers import mixed_prompts
from tests.models import padded_batch
from tests.tp.ranks import run_ranks

NEW_TOKENS = 8
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 24, "num_blocks": 48, "block_size": 4}


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def saved_latent_model(request, tmp_path_factory):
    from tests.hf.tiny_configs import tiny_config
    from tests.models import FAMILIES

    path = tmp_path_factory.mktemp(request.param)
    overrides = FAMILIES[request.param][1] if request.param in FAMILIES else {}  # V3.2: sparse attention
    torch.manual_seed(0)
    config = tiny_config(request.param, vocab_size=96, **overrides)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _generate_rank(path: str, batch: dict) -> dict:
    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    hfaccel.accelerate(model, attention="torch")
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    runner = model.hfaccel.session.runner
    heads = {layer: latent.heads for layer, latent in runner.absorbed.items()}
    return {"out": out, "decode": str(model.hfaccel.decode), "heads": heads}


def test_generate_under_tp_reads_each_ranks_heads_in_the_latent_space(saved_latent_model, tmp_path):
    batch = padded_batch()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_latent_model, dtype=torch.float32)
    expected = single.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    sharded = single.config.model_type in ("deepseek_v2", "deepseek_v32")
    heads = single.config.num_attention_heads // (2 if sharded else 1)

    ranks = run_ranks(_generate_rank, str(saved_latent_model), batch, workdir=tmp_path, timeout=120)

    for rank, got in enumerate(ranks):
        assert got["decode"] == "hfaccel", f"rank {rank}: {got['decode']}"
        assert got["heads"] == dict.fromkeys(range(single.config.num_hidden_layers), heads), f"rank {rank}"
        assert torch.equal(got["out"], expected), f"rank {rank}"


def _engine_rank(path: str, prompts: list[list[int]], budgets: list[int]) -> dict:
    import hfaccel
    from hfaccel.engine import SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    engine = hfaccel.Engine(hfaccel.accelerate(model, attention="torch"), cuda_graphs=True, **ENGINE)
    if not engine.is_leader:
        return {"forwards": engine.follow()}
    try:
        params = [SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True) for budget in budgets]
        outputs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    return {"outputs": [out.outputs[0].token_ids for out in outputs], "absorbed": sorted(engine.runner.absorbed)}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v32"])
def test_engine_under_tp_with_sharded_latent_heads(model_type, tmp_path):
    """DeepSeek-V2's sharded heads (V3.2's with its sparse attention) through the engine's static decode steps: the
    single process's tokens."""
    import hfaccel
    from hfaccel.engine import SamplingParams
    from tests.hf.tiny_configs import tiny_config
    from tests.models import FAMILIES

    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=96, **(FAMILIES[model_type][1] if model_type in FAMILIES else {}))
    single = transformers.AutoModelForCausalLM.from_config(config).eval()
    single.save_pretrained(tmp_path / "model")
    prompts, budgets = mixed_prompts(count=8)
    params = [SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True) for budget in budgets]
    engine = hfaccel.Engine(hfaccel.accelerate(single, attention="torch"), **ENGINE)
    expected = [out.outputs[0].token_ids for out in engine.generate(prompts, params)]

    leader, follower = run_ranks(_engine_rank, str(tmp_path / "model"), prompts, budgets, workdir=tmp_path, timeout=180)

    assert leader["outputs"] == expected
    assert leader["absorbed"] == list(range(config.num_hidden_layers)) and follower["forwards"] > 0
