"""Put on the ``PYTHONPATH`` of a ``hfaccel serve`` test process (Python imports ``sitecustomize`` at start-up): the
first forward of more tokens than ``HFACCEL_TEST_LOSE_DEVICE`` says raises the error Triton's launcher raises for an
illegal memory access, and the device fails every call from then on, as a CUDA context that keeps its error does (a
CPU cannot lose its context)."""

import os

if "HFACCEL_TEST_LOSE_DEVICE" in os.environ:
    from hfaccel import device
    from hfaccel.runner import runner

    lost = []
    device.device_works = lambda where: not lost
    forward = runner.ModelRunner.forward

    def losing(self, seq_ids, input_ids, *args, **kwargs):
        if lost or len(input_ids) > int(os.environ["HFACCEL_TEST_LOSE_DEVICE"]):
            lost.append(True)
            raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered (simulated)")
        return forward(self, seq_ids, input_ids, *args, **kwargs)

    runner.ModelRunner.forward = losing
