"""int4 (RTN) under tensor parallelism over 2 gloo ranks: each rank quantizes its shard, the shards are exactly the
matching parts of the single-process int4 weights, greedy tokens equal int4 single-process's, and a group size
that a rowwise shard cannot be split on is a clear error naming the layer."""

from __future__ import annotations

import torch
import transformers

from tests.models import padded_batch
from tests.tp.ranks import run_ranks

GROUP = 16  # tiny Llama: hidden 64, intermediate 96 -> rowwise shards of K = 32 (o_proj) and 48 (down_proj)
NEW_TOKENS = 10
LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj")


def _int4_rank(path: str, batch: dict) -> dict:
    import hfaccel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    try:  # 32: down_proj's K = 96 quantizes on one process, its shards of 48 cannot
        hfaccel.accelerate(model, attention="torch", quantize="rtn", group_size=32)
        error = None
    except ValueError as raised:
        error = str(raised)
    unchanged = type(model.get_submodule(LAYERS[0])).__name__
    hfaccel.accelerate(model, attention="torch", quantize="rtn", group_size=GROUP)
    tokens = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    layers = {name: model.get_submodule(name) for name in LAYERS}
    return {
        "error": error,
        "unchanged": unchanged,
        "tokens": tokens,
        "decode": str(model.hfaccel.decode),
        "types": {name: type(layer).__name__ for name, layer in layers.items()},
        "weights": {name: (layer.qweight, layer.scales, layer.zeros) for name, layer in layers.items()},
    }


def test_int4_under_tp_equals_int4_single_process(saved_llama, tmp_path, monkeypatch):
    import hfaccel

    # the int4 matmuls on their torch path, here and on the ranks: the sharding is under test (kernels: tests/kernels)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = padded_batch()
    single = transformers.AutoModelForCausalLM.from_pretrained(saved_llama, dtype=torch.float32)
    hfaccel.accelerate(single, attention="torch", quantize="rtn", group_size=GROUP)
    expected = single.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)

    ranks = run_ranks(_int4_rank, str(saved_llama), batch, workdir=tmp_path, timeout=120)

    for rank, got in enumerate(ranks):
        assert got["error"] is not None and "model.layers.0.mlp.down_proj (rowwise" in got["error"], got["error"]
        assert "split 2 ways into multiples of group_size (32)" in got["error"]
        assert got["unchanged"] == "Linear"  # the failed call changed nothing
        assert got["types"] == {LAYERS[0]: "Int4Linear", LAYERS[1]: "RowwiseInt4Linear", LAYERS[2]: "RowwiseInt4Linear"}
        for name, (qweight, scales, zeros) in got["weights"].items():
            whole = single.get_submodule(name)
            if name.endswith("q_proj"):  # colwise: this rank's output columns ([K/8, N] layout)
                columns = slice(rank * qweight.shape[1], (rank + 1) * qweight.shape[1])
                parts = (whole.qweight[:, columns], whole.scales[:, columns], whole.zeros[:, columns])
            else:  # rowwise: this rank's input rows, whole groups
                rows, groups = qweight.shape[0], scales.shape[0]
                parts = (
                    whole.qweight[rank * rows : (rank + 1) * rows],
                    whole.scales[rank * groups : (rank + 1) * groups],
                    whole.zeros[rank * groups : (rank + 1) * groups],
                )
            for got_part, want in zip((qweight, scales, zeros), parts):
                assert torch.equal(got_part, want), f"rank {rank} {name}"
        assert got["decode"] == "hfaccel"
        assert torch.equal(got["tokens"], expected), f"rank {rank}"
