"""``distributed.launch.supervise``, the launcher of ``hfaccel serve`` and ``hfaccel bench engine`` over several
ranks: a rank whose work returned exits 0 whatever its interpreter's exit would do; a rank that raises fails the run
with its traceback."""

from __future__ import annotations

import atexit
import os

import pytest

from hfaccel.distributed.launch import RankFailed, supervise


def _done_with_a_finalizer_that_aborts() -> None:
    atexit.register(os.abort)  # what a process group's thread did now and then at the interpreter's exit: SIGABRT


def _rank_one_raises() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one's bad input")


def test_a_rank_whose_work_returned_exits_without_finalizing():
    supervise(_done_with_a_finalizer_that_aborts, (), 2)  # raises RankFailed (signal SIGABRT) if a rank finalizes


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailed, match="rank 1 of 2 failed: it raised an error") as failure:
        supervise(_rank_one_raises, (), 2)
    assert "ValueError: rank one's bad input" in str(failure.value)
