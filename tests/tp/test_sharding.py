"""One process: the TP step message round-trips, and models sharded in ways hfaccel cannot serve give clear errors
(the TP size and plan faked through ``hfaccel.compat``, where hfaccel reads them)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

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


@pytest.mark.parametrize("offsets", [None, torch.tensor([0] * 7 + [-5])], ids=["no offsets", "offsets"])
@pytest.mark.parametrize("keep", [0, torch.tensor([6, 7])], ids=["all", "rows"])
def test_step_message_round_trips(keep, offsets):
    step, input_ids = replace(_step(), offsets=offsets), torch.arange(10, 18)  # [T = 8]
    channel = StepChannel(_OneRank(), StepLimits(max_tokens=8, max_seqs=2, max_blocks=4), torch.device("cpu"))
    channel.send_forward(input_ids, step, keep, [BlockCopy(3, 5)])
    message = channel.receive()
    assert message.copies == [BlockCopy(3, 5)] and torch.equal(message.input_ids, input_ids)
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "positions"):
        got, want = getattr(message.step, name), getattr(step, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert (message.step.max_seq_len, message.step.max_q_len) == (step.max_seq_len, step.max_q_len)
    assert (message.step.offsets is None) == (offsets is None)
    assert offsets is None or torch.equal(message.step.offsets, offsets)
    assert torch.equal(torch.as_tensor(message.keep), torch.as_tensor(keep))
    channel.send_stop()
    assert channel.receive().kind == STOP


def _tree_rank() -> dict:
    """What the leader's tree (every kind of leaf a prefill's inputs hold) is on this rank, after its prefill
    message."""
    import torch.distributed as dist

    from hfaccel.distributed.model import TensorParallel
    from hfaccel.distributed.steps import PREFILL

    tp = TensorParallel(dist.group.WORLD, 2, dist.get_rank(), 0, torch.device("cpu"))
    channel = StepChannel(tp, StepLimits(max_tokens=4, max_seqs=2, max_blocks=4), torch.device("cpu"))
    if not tp.is_leader:
        message = channel.receive()
        assert message.kind == PREFILL
        return {"copies": message.copies, **message.prefill}
    torch.manual_seed(0)
    inputs = {
        "pixel_values": torch.randn(3, 5, dtype=torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 4, 6]]),
        "encoded": {"image": [torch.randn(7, 3), (torch.ones(2, dtype=torch.bool), None)]},
        "note": "text",
    }
    sent = {"input_ids": torch.arange(9), "block_table": torch.tensor([3, 1], dtype=torch.int32), "keep": [2, 5]}
    channel.send_prefill(sent["input_ids"], sent["block_table"], sent["keep"], inputs, [BlockCopy(1, 2)])
    return {"copies": [BlockCopy(1, 2)], **sent, "inputs": inputs}


def test_a_prefills_inputs_reach_the_followers_whole(tmp_path):
    """A prompt's multimodal prefill message: its tokens (more than the step buffer holds), its block table, its kept
    rows and its inputs — nested dicts, lists and tuples of tensors of any dtype and plain values — and the block
    copies before it, on the follower as the leader sent them."""
    from tests.tp.ranks import run_ranks

    sent, received = run_ranks(_tree_rank, workdir=tmp_path, timeout=60)
    assert received["copies"] == sent["copies"] and received["keep"] == sent["keep"]
    assert received["inputs"]["note"] == "text" and received["inputs"]["encoded"]["image"][1][1] is None
    pairs = [(received["input_ids"], sent["input_ids"]), (received["block_table"], sent["block_table"])]
    pairs += [(received["inputs"][k], sent["inputs"][k]) for k in ("pixel_values", "image_grid_thw")]
    pairs += [(r, s) for r, s in zip(received["inputs"]["encoded"]["image"][:1], sent["inputs"]["encoded"]["image"])]
    pairs += [(received["inputs"]["encoded"]["image"][1][0], sent["inputs"]["encoded"]["image"][1][0])]
    for got, want in pairs:
        assert got.dtype == want.dtype and torch.equal(got, want)


def _settle_rank(cases: list[tuple[bool, bool]]) -> list[str]:
    """Each case: whether each rank's forward raised (a rank whose forward succeeded settles nothing: it waits for the
    next step, or is inside a collective its peer left), then what this rank's settle gave; a diverged channel's steps
    too."""
    import datetime
    import time

    import torch.distributed as dist

    from hfaccel.distributed import steps

    steps.VERDICT_TIMEOUT = datetime.timedelta(seconds=2)
    tp = TensorParallel(dist.group.WORLD, 2, dist.get_rank(), 0, torch.device("cpu"))
    seen = []
    for case in cases:
        channel = StepChannel(tp, StepLimits(4, 2, 4), torch.device("cpu"), steps.verdict_group(tp))
        if not case[tp.rank]:
            time.sleep(3)
            seen.append("went on")
            continue
        try:
            channel.settle(ValueError("image features and image tokens do not match"))
            seen.append("settled")
        except steps.TensorParallelError as error:
            assert channel.broken is error
            channel.send_stop()  # a no-op: nothing is sent to ranks that diverged
            with pytest.raises(steps.TensorParallelError):
                channel.send_forward(torch.arange(2), _step_of(2), 0, [])
            seen.append(f"broken: {error}")
    return seen


def _step_of(tokens: int):
    pool = KVPool(tiny_model("llama").config, num_blocks=4, block_size=4)
    pool.reserve(["a"], [tokens])
    return pool.packed_step(["a"], [0], [tokens])


def test_a_forward_that_raised_on_every_rank_is_settled_and_one_that_did_not_stops_its_rank(tmp_path):
    """A rank whose forward raised waits, in a group whose wait is bounded, for every other rank to say theirs raised
    too: all did (its inputs' error), and each goes on; one did not (its forward succeeded: it is waiting for the next
    step, or inside a collective), and the rank stops with TensorParallelError within the bound, its channel sending
    nothing more (not even the stop message) — no rank waits forever."""
    from tests.tp.ranks import run_ranks

    cases = [(True, True), (True, False), (False, True), (True, True)]
    leader, follower = run_ranks(_settle_rank, cases, workdir=tmp_path, timeout=60)
    assert leader[0] == follower[0] == leader[3] == follower[3] == "settled"
    assert leader[2] == follower[1] == "went on"
    for broken in (leader[1], follower[2]):
        assert broken.startswith("broken: TP rank ") and "raised ValueError('image features" in broken, broken
        assert "not every rank said it raised there too within 0:00:02" in broken, broken
    assert leader[1].startswith("broken: TP rank 0") and follower[2].startswith("broken: TP rank 1")


def test_a_tree_with_leaves_of_another_kind_is_refused_before_anything_is_sent():
    """An object pytree does not open (a BatchFeature, a PIL image) would travel pickled, its tensors on the leader's
    device: refused, naming its type."""
    from PIL import Image

    with pytest.raises(TypeError, match="tensors and plain values in dicts, lists and tuples; got Image"):
        _OneRank().broadcast_tree({"pixel_values": torch.ones(2), "images": [Image.new("RGB", (2, 2))]})


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


def test_tp_size_that_does_not_divide_a_layers_kv_heads(monkeypatch):
    """Gemma 4's layers differ: its global layers have fewer KV heads (1 here) than its sliding ones (2)."""
    from tests.models import gemma4_config

    model = transformers.AutoModelForCausalLM.from_config(gemma4_config())
    _fake_tp(monkeypatch, 2)
    with pytest.raises(
        ValueError, match=r"every layer's KV heads \(layers have \[1, 2\]\).*num_key_value_heads=1, tp_size=2"
    ):
        hfaccel.accelerate(model, attention="torch")
    assert not hasattr(model, "hfaccel")


def test_images_are_encoded_ahead_only_where_tp_leaves_the_vision_tower_whole(monkeypatch):
    """The leader encodes a step's images alone, ahead of their prefills, unless the TP plan splits the vision tower
    (Gemma 4's): its collectives need every rank, so each rank's prefill forward encodes them."""
    from hfaccel.distributed import shards_beyond_language_model
    from hfaccel.runner.multimodal import EncoderCache
    from tests.hf.vlm_models import CASES

    qwen, gemma4 = CASES["qwen2_5_vl"].model(), CASES["gemma4"].model()
    assert not shards_beyond_language_model(qwen)  # not sharded: no plan in force
    monkeypatch.setattr(transformers_compat, "tp_size", lambda model: 2)  # the models' own plans in force
    assert not shards_beyond_language_model(qwen) and not shards_beyond_language_model(CASES["gemma3"].model())
    assert shards_beyond_language_model(gemma4)
    inputs = {"pixel_values": torch.ones(1, 3, 8, 8)}
    cache = EncoderCache(ahead=False)
    assert cache.inputs(gemma4, [("digest", inputs, [1, 2], ())]) == [inputs]
    assert (cache.hits, cache.misses) == (0, 0)


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
