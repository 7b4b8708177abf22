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
