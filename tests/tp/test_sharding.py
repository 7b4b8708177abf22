"""One process: the TP step message round-trips, and models sharded in ways hfaccel cannot serve give clear errors
(the TP size and plan faked through ``hfaccel.compat``, where hfaccel reads them)."""

from __future__ import annotations

import pytest
import torch

import hfaccel
from hfaccel import compat
from hfaccel.compat import transformers as transformers_compat
from hfaccel.distributed.model import TensorParallel
from hfaccel.distributed.steps import STOP, StepChannel, StepLimits
from hfaccel.kv import KVPool
from hfaccel.kv.block_manager import BlockCopy
from tests.models import tiny_model


class _OneRank(TensorParallel):
    """A TP group of one process: a broadcast leaves the buffer as it is, so a receive reads what was sent."""

    def __init__(self, rank: int = 0):
        super().__init__(group=None, size=2, rank=rank, leader=0, device=torch.device("cpu"))

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _step():
    pool = KVPool(tiny_model("llama").config, num_blocks=16, block_size=4)
    pool.reserve(["a", "b"], [7, 2])
    return pool.packed_step(["a", "b"], [0, 1], [7, 1])


@pytest.mark.parametrize("keep", [0, torch.tensor([6, 7])], ids=["all", "rows"])
def test_step_message_round_trips(keep):
    step, input_ids = _step(), torch.arange(10, 18)  # [T = 8]
    channel = StepChannel(_OneRank(), StepLimits(max_tokens=8, max_seqs=2, max_blocks=4), torch.device("cpu"))
    channel.send_forward(input_ids, step, keep, [BlockCopy(3, 5)])
    message = channel.receive()
    assert message.copies == [BlockCopy(3, 5)] and torch.equal(message.input_ids, input_ids)
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "positions"):
        got, want = getattr(message.step, name), getattr(step, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert (message.step.max_seq_len, message.step.max_q_len) == (step.max_seq_len, step.max_q_len)
    assert torch.equal(torch.as_tensor(message.keep), torch.as_tensor(keep))
    channel.send_stop()
    assert channel.receive().kind == STOP


def test_step_larger_than_the_buffer_is_a_clear_error():
    channel = StepChannel(_OneRank(), StepLimits(max_tokens=4, max_seqs=2, max_blocks=4), torch.device("cpu"))
    with pytest.raises(ValueError, match="a forward of 8 tokens, 2 sequences .* exceeds the TP step buffer"):
        channel.send_forward(torch.arange(8), _step(), 0, [])


def _fake_tp(monkeypatch, size: int) -> None:
    plan = {"model.layers.*.self_attn.k_proj": "colwise"}
    for module in (compat, transformers_compat):  # callers read compat's names; its other shims, the module's
        monkeypatch.setattr(module, "tp_size", lambda model: size)
        monkeypatch.setattr(module, "tp_plan", lambda model: plan)


def test_tp_size_that_does_not_divide_the_kv_heads(monkeypatch):
    model = tiny_model("llama")  # 2 KV heads
    _fake_tp(monkeypatch, 4)
    with pytest.raises(ValueError, match=r"divide the model's KV heads.*num_key_value_heads=2, tp_size=4"):
        hfaccel.accelerate(model, attention="torch")
    assert not hasattr(model, "hfaccel")


def test_calibrated_int4_under_tp_is_a_clear_error(monkeypatch):
    model = tiny_model("llama")
    _fake_tp(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"quantizes each rank's shard with RTN.*quantize='awq' calibrates on one"):
        hfaccel.accelerate(model, attention="torch", quantize="awq")


def test_device_map_across_devices_says_what_is_supported():
    model = tiny_model("llama")
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": 0, "lm_head": "cpu"}
    with pytest.raises(ValueError, match=r"tp_plan=\"auto\"\) under torchrun.*split across devices \['0', 'cpu'\]"):
        hfaccel.accelerate(model)
    with pytest.raises(ValueError, match="hfaccel.Engine: hfaccel serves a model on one device"):
        hfaccel.Engine(model)


def test_a_follower_engine_takes_no_requests():
    engine = hfaccel.Engine(hfaccel.accelerate(tiny_model("llama"), attention="torch"), num_blocks=8)
    engine.tp = _OneRank(rank=1)
    with pytest.raises(RuntimeError, match="rank 1 of 2 follows TP rank 0.*engine.follow"):
        engine.generate([[5, 6, 7]])


def test_fp8_checkpoint_layers_under_tp_are_a_clear_error(monkeypatch):
    """A model whose Linear layers hold fp8 weights as a checkpoint loaded them (here compressed-tensors'
    convention: an nn.Linear with an fp8 weight) is refused under TP with the way that works; accelerate changes
    nothing."""
    model = tiny_model("llama")
    proj = model.model.layers[0].self_attn.q_proj
    proj.weight.data = proj.weight.data.to(torch.float8_e4m3fn)
    _fake_tp(monkeypatch, 2)
    with pytest.raises(
        ValueError,
        match=r"fp8 checkpoint's layers under tensor parallelism \(e\.g\. "
        r"model\.layers\.0\.self_attn\.q_proj\).*quantize=\"fp8\"",
    ):
        hfaccel.accelerate(model, attention="torch")
    assert not hasattr(model, "hfaccel")
