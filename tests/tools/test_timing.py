"""The benchmarks' timing rules (hfaccel.tools.bench.timing): serving runs each warmed up once, then timed
A B C C B A, and of its two timings the slower counts; kernels timed over enough copies of their operands that
none is read from the L2."""

from types import SimpleNamespace

import torch

from hfaccel.tools.bench import timing
from hfaccel.tools.bench.timing import interleaved_runs, l2_cold_copies, median_run


def test_runs_are_warmed_up_then_timed_in_mirrored_order_and_the_slower_counts():
    order, speeds = [], {"a": iter([0, 5.0, 3.0]), "b": iter([0, 2.0, 4.0]), "c": iter([0, 1.0, 1.0])}

    def run(key):
        order.append(key)
        return key, next(speeds[key])

    rows = interleaved_runs({key: lambda key=key: run(key) for key in "abc"}, speed=lambda row: row[1])
    assert order == list("abc") + list("abccba")
    assert rows == {"a": ("a", 3.0), "b": ("b", 2.0), "c": ("c", 1.0)}
    assert median_run([("x", 3.0), ("y", 1.0), ("z", 2.0)], speed=lambda row: row[1]) == ("z", 2.0)


def test_cold_copies_of_operands_span_twice_the_l2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=60 << 20))
    cuda = torch.device("cuda")
    assert l2_cold_copies(8 << 20, cuda) == 15  # 8 MB of int4 weights: 15 copies, 120 MB
    assert l2_cold_copies(117 << 20, cuda) == 2
    assert l2_cold_copies(1 << 30, cuda) == 1
    assert l2_cold_copies(1 << 10, cuda) == 64  # at most 64
    assert l2_cold_copies(8 << 20, torch.device("cpu")) == 1


def test_cold_graph_timing_off_cuda_times_the_first_call(monkeypatch):
    timed = []
    monkeypatch.setattr(timing, "time_ms", lambda fn, device, reps: timed.append((fn, reps)) or 1.5)
    first, second = (lambda: None), (lambda: None)
    assert timing.cold_graph_time_ms([first, second], torch.device("cpu"), reps=3) == 1.5
    assert timed == [(first, 3)]


def test_a_steps_weight_read_counts_the_experts_its_tokens_reach():
    """The roofline's bytes: a dense model's weights once whatever the batch (the input embedding table left out);
    of a mixture of experts' banks (4 experts, 2 per token), the share ``tokens`` uniformly routed tokens reach —
    half for one token, three quarters for two — and the routers whole."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    dense = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=96))
    whole = nbytes([*dense.parameters(), *dense.buffers()]) - nbytes([dense.get_input_embeddings().weight])
    assert timing.weight_read_bytes(dense) == timing.weight_read_bytes(dense, 16) == whole

    moe = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral", vocab_size=96, num_experts_per_tok=2))
    banks = [module for name, module in moe.named_modules() if name.endswith(".experts")]
    assert banks and all(bank.num_experts == 4 for bank in banks)
    experts = nbytes(p for bank in banks for p in bank.parameters())
    rest = nbytes([*moe.parameters(), *moe.buffers()]) - nbytes([moe.get_input_embeddings().weight]) - experts
    assert timing.weight_read_bytes(moe) == rest + experts / 2
    assert timing.weight_read_bytes(moe, 2) == rest + experts * 3 / 4


def test_experts_per_token_reads_each_familys_name_for_it():
    """The ``k`` of the roofline's routed share, by the names families give it (0 on a dense model)."""
    from tests.hf.tiny_configs import tiny_config
    from tests.models import gemma4_config

    assert timing.experts_per_token(tiny_config("mixtral", num_experts_per_tok=2)) == 2
    gemma4 = gemma4_config()
    gemma4.enable_moe_block, gemma4.num_experts, gemma4.top_k_experts = True, 4, 3
    assert timing.experts_per_token(gemma4) == 3
    assert timing.experts_per_token(tiny_config("llama")) == 0
