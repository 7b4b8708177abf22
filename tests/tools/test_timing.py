"""The serving benchmarks' one timing rule (hfaccel.tools.bench.timing): each run warmed up once, then timed
A B C C B A, and of its two timings the slower counts."""

from hfaccel.tools.bench.timing import interleaved_runs, median_run


def test_runs_are_warmed_up_then_timed_in_mirrored_order_and_the_slower_counts():
    order, speeds = [], {"a": iter([0, 5.0, 3.0]), "b": iter([0, 2.0, 4.0]), "c": iter([0, 1.0, 1.0])}

    def run(key):
        order.append(key)
        return key, next(speeds[key])

    rows = interleaved_runs({key: lambda key=key: run(key) for key in "abc"}, speed=lambda row: row[1])
    assert order == list("abc") + list("abccba")
    assert rows == {"a": ("a", 3.0), "b": ("b", 2.0), "c": ("c", 1.0)}
    assert median_run([("x", 3.0), ("y", 1.0), ("z", 2.0)], speed=lambda row: row[1]) == ("z", 2.0)
