"""``generate()`` of an accelerated model transformers sharded with ``tp_plan="auto"``: 2 ranks over gloo run
hfaccel's decode loop in lockstep, and their tokens equal the single-process model's (greedy and seeded sampling,
a left-padded batch of 3, Llama and Qwen2 with GQA)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.models import padded_batch, tiny_model
from tests.tp.ranks import run_ranks

NEW_TOKENS = 10
SEED = 1234


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param).save_pretrained(path)
    return path


def _generate(model, batch: dict) -> dict:
    greedy = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.manual_seed(SEED)  # the same seed on every rank, as transformers' own TP generate() needs
    sampled = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.5, top_k=0)
    return {"greedy": greedy, "sampled": sampled}


def _tp_rank(path: str, batch: dict) -> dict:
    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    hfaccel.accelerate(model, attention="torch")  # "torch": hfaccel's decode loop on the CPU too
    out = _generate(model, batch)
    session = model.hfaccel.session
    return {
        **out,
        "decode": str(model.hfaccel.decode),
        "pool_kv_heads": session.runner.pool.group_shapes[0][0],
        "config_kv_heads": model.config.num_key_value_heads,
    }


def test_generate_under_tp_equals_single_process(saved_model, tmp_path):
    batch = padded_batch()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    expected = _generate(single, batch)

    ranks = run_ranks(_tp_rank, str(saved_model), batch, workdir=tmp_path, timeout=120)

    for rank, got in enumerate(ranks):
        assert got["decode"] == "hfaccel", f"rank {rank}: {got['decode']}"
        assert got["pool_kv_heads"] == got["config_kv_heads"] // 2  # the rank's share of the KV heads
        assert torch.equal(got["greedy"], expected["greedy"]), f"rank {rank} greedy"
        assert torch.equal(got["sampled"], expected["sampled"]), f"rank {rank} sampled"
