"""A second process does not compile the decode step again: AOTAutograd's traced graphs and inductor's compiled ones,
of hfaccel's step (its custom ops included) and of transformers' compiled forward that ``compile=True`` runs on a CPU
without Triton, are cacheable, so ``compile=True`` pays most of its compile time once per machine, not once per run
(dynamo's tracing of the Python code is paid by every process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, torch
from torch._dynamo.utils import counters
import hfaccel
from tests.models import padded_batch, tiny_model
model = hfaccel.accelerate(tiny_model("llama"), attention=ATTENTION, compile=True)
model.generate(**padded_batch(), max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
if ATTENTION == "torch":  # hfaccel's loop and compiled step
    assert model.hfaccel.decode.path == "hfaccel" and "uncompiled" not in model.hfaccel.session.steps()
else:  # a CPU without Triton: transformers' loop, its static cache and compiled forward
    assert "its static cache and compiled forward" in model.hfaccel.decode.reason, model.hfaccel.decode
print(json.dumps({**{key: counters["inductor"][key] for key in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                                 "fxgraph_cache_bypass")},
                  **{key: counters["aot_autograd"][key] for key in ("autograd_cache_hit", "autograd_cache_miss",
                                                                     "autograd_cache_bypass")}}))
"""


def _run(cache_dir: Path, attention: str) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_INTERPRET": "0"}
    script = f"ATTENTION = {attention!r}\n{SCRIPT}"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["torch", "auto"], ids=["hfaccel-step", "cpu-static-forward"])
def test_a_second_process_reuses_the_compiled_decode_step(tmp_path, attention):
    first = _run(tmp_path, attention)
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_bypass"] == 0, first
    assert first["autograd_cache_miss"] > 0 and first["autograd_cache_bypass"] == 0, first
    second = _run(tmp_path, attention)
    assert second["fxgraph_cache_hit"] >= first["fxgraph_cache_miss"] and second["fxgraph_cache_miss"] == 0, second
    # AOTAutograd's cache too: the second process skips tracing the graph's forward (half of a compile), not only
    # inductor's code generation
    assert second["autograd_cache_hit"] == first["autograd_cache_miss"] and second["autograd_cache_miss"] == 0, second
