"""An engine process's role under tensor parallelism: the leader (TP rank 0) takes every request and sends each
forward to the other ranks; a follower runs those forwards until the leader shuts them down."""

from __future__ import annotations

from hfaccel.distributed.model import TensorParallel
from hfaccel.distributed.steps import StepChannel, follow
from hfaccel.runner import ModelRunner


class TPRole:
    """A part of ``hfaccel.Engine``: its ``tp`` ranks (None: one process), its ``runner`` and the ``_channel`` its
    forwards go through (None: one process, or shut down)."""

    tp: TensorParallel | None
    runner: ModelRunner
    _channel: StepChannel | None

    @property
    def is_leader(self) -> bool:
        """Whether this process takes requests: always on one process; under tensor parallelism, TP rank 0."""
        return self.tp is None or self.tp.is_leader

    def follow(self) -> int:
        """Run rank 0's forwards on this rank (a TP rank other than 0) until rank 0 calls :meth:`shutdown`;
        returns how many ran."""
        if self.is_leader:
            raise RuntimeError(
                "Engine.follow() is for the TP ranks other than 0; this process is the leader (it "
                "takes the requests: generate, add_request, stream...)"
            )
        return follow(self.runner, self._channel)

    def shutdown(self) -> None:
        """Stop the follower ranks (rank 0 under tensor parallelism; once; a no-op otherwise)."""
        if self._channel is not None and self.is_leader:
            self._channel.send_stop()
            self._channel = None

    def _need_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"Engine.{what}: rank {self.tp.rank} of {self.tp.size} follows TP rank 0, which takes "
                "every request; call engine.follow() on this rank"
            )
