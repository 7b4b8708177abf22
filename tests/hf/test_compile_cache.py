"""A second process does not compile the decode step again: inductor's compiled graphs of hfaccel's step (its custom
ops included) are cacheable, so ``compile=True`` pays its compile time once per machine, not once per run."""

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
model = hfaccel.accelerate(tiny_model("llama"), attention="torch", compile=True)
model.generate(**padded_batch(), max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
assert model.hfaccel.decode.path == "hfaccel" and "uncompiled" not in model.hfaccel.session.steps()
print(json.dumps({key: counters["inductor"][key] for key in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                               "fxgraph_cache_bypass")}))
"""


def _run(cache_dir: Path) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_reuses_the_compiled_decode_step(tmp_path):
    first = _run(tmp_path)
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_bypass"] == 0, first
    second = _run(tmp_path)
    assert second["fxgraph_cache_hit"] >= first["fxgraph_cache_miss"] and second["fxgraph_cache_miss"] == 0, second
