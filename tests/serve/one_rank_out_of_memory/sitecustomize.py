"""Put on the ``PYTHONPATH`` of a ``hfaccel serve`` test process (Python imports ``sitecustomize`` at start-up, in
the spawned TP ranks too): on the rank ``HFACCEL_TEST_OOM_RANK`` names, every multimodal prefill runs out of memory,
as one GPU's can alone; a rank whose forward raised waits 3 s, not minutes, for the others to say theirs did."""

import os

if "HFACCEL_TEST_OOM_RANK" in os.environ:
    import datetime

    import torch
    import torch.distributed as dist

    from hfaccel.distributed import steps
    from hfaccel.runner import runner

    def _on_one_rank(prefill):
        def out_of_memory(*args, **kwargs):
            if dist.is_initialized() and dist.get_rank() == int(os.environ["HFACCEL_TEST_OOM_RANK"]):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, on this rank alone)")
            return prefill(*args, **kwargs)

        return out_of_memory

    steps.VERDICT_TIMEOUT = datetime.timedelta(seconds=3)
    runner.prefill_sequence = _on_one_rank(runner.prefill_sequence)  # the leader's prefill
    steps.prefill_on_blocks = _on_one_rank(steps.prefill_on_blocks)  # a follower's
