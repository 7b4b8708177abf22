"""fp8 under tensor parallelism over 2 gloo ranks: each rank quantizes its shard per output channel — a rowwise
shard with the whole rows' scales, agreed by an all-reduce — so the shards are exactly the matching parts of the
single-process fp8 weights, and greedy tokens equal fp8 single-process's."""

from __future__ import annotations

import torch
import transformers

from tests.models import padded_batch
from tests.tp.ranks import run_ranks

NEW_TOKENS = 10
LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj")


def _fp8_rank(path: str, batch: dict) -> dict:
    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    hfaccel.accelerate(model, attention="torch", quantize="fp8")
    tokens = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    layers = {name: model.get_submodule(name) for name in LAYERS}
    return {
        "tokens": tokens,
        "decode": str(model.hfaccel.decode),
        "types": {name: type(layer).__name__ for name, layer in layers.items()},
        "weights": {name: (layer.weight.view(torch.uint8), layer.weight_scale) for name, layer in layers.items()},
    }


def test_fp8_under_tp_equals_fp8_single_process(saved_llama, tmp_path, monkeypatch):
    import hfaccel

    # the fp8 matmuls on their torch path, here and on the ranks: the sharding is under test (kernels: tests/kernels)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = padded_batch()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.float32)
    hfaccel.accelerate(single, attention="torch", quantize="fp8")
    expected = single.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)

    ranks = run_ranks(_fp8_rank, str(saved_llama), batch, workdir=tmp_path, timeout=120)

    for rank, got in enumerate(ranks):
        assert got["types"] == {LAYERS[0]: "Fp8Linear", LAYERS[1]: "RowwiseFp8Linear", LAYERS[2]: "RowwiseFp8Linear"}
        for name, (weight, scale) in got["weights"].items():
            whole = single.get_submodule(name)  # weight [K, N] e4m3, per-channel scales [1, N]
            if name.endswith("q_proj"):  # colwise: this rank's output columns, with their scales
                columns = slice(rank * weight.shape[1], (rank + 1) * weight.shape[1])
                parts = (whole.weight.view(torch.uint8)[:, columns], whole.weight_scale[:, columns])
            else:  # rowwise: this rank's input rows, scaled as the whole layer's
                rows = slice(rank * weight.shape[0], (rank + 1) * weight.shape[0])
                parts = (whole.weight.view(torch.uint8)[rows], whole.weight_scale)
            for got_part, want in zip((weight, scale), parts):
                assert torch.equal(got_part, want), f"rank {rank} {name}"
        assert got["decode"] == "hfaccel"
        assert torch.equal(got["tokens"], expected), f"rank {rank}"
