"""Shared helpers for kernel tests: comparison with a readable report, and sm_90 compilation with no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]

# (atol, rtol) per dtype for a kernel output compared with its fp32 reference:
# - fp32: the only difference is summation order / online softmax rescaling (~1e-6 relative).
# - fp16: the output is rounded to fp16 (half-ulp 4.9e-4 at |x| <= 1) and the kernel rounds softmax
#   probabilities to fp16 before the P @ V matmul, as every flash kernel does (another ~5e-4 relative).
# - bf16: the same two roundings at bf16's 8-bit mantissa (half-ulp 3.9e-3), plus fp32->bf16 truncation
#   in the Triton interpreter (1 ulp).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# torch's CPU int4 kernel computes in bf16 whatever the activation dtype (x, scale and zero rounded to bf16, fp32
# sums, the output rounded to bf16): bf16's tolerance of the output's scale, for every dtype.
INT4PACK_TOLERANCE = TOLERANCES[torch.bfloat16][1]

TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.bool: "i1",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """assert_close with the per-dtype tolerances above and a report of where the tensors differ."""
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    actual, expected = actual.float(), expected.float()
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    if bad.any():
        diff = (actual - expected).abs()
        worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
            f"max abs diff {diff.max().item():.3g} at {worst}: actual {actual[worst].item():.6g}, "
            f"expected {expected[worst].item():.6g}; first bad indices {torch.nonzero(bad)[:5].tolist()}"
        )


def compile_sm90(jobs: list[dict]) -> list[dict]:
    """Compile @triton.jit kernels to sm_90 cubins with triton's bundled ptxas: no GPU, no driver.

    Each job: ``{"module", "kernel", "signature": {arg: triton type}, "constexprs": {...}, "num_warps",
    "num_stages"}``, optionally ``"divisible": [arg names]`` and ``"ptx_patterns": [text, ...]``. A launch
    specialises as :func:`launch_like` says (integer arguments equal to 1 become constants, pointers and integers
    divisible by 16 are marked so), and only then does Triton vectorise and pipeline the loads (cp.async / TMA)
    and use the shared memory it will on the GPU; jobs should do the same. Returns per job ``{"ok": True,
    "shared": bytes, "ptx_counts": {pattern: occurrences in the PTX}}`` or ``{"ok": False, "error": text}``;
    an error is what the GPU compiler rejects (e.g. a tl.dot with K < 16 on 16-bit inputs). Jobs that are equal
    (two cases that launch the kernel alike) are compiled once. Runs in a child process because the kernels of this
    (interpreted) process are not compilable.
    """
    keys = [json.dumps(job, sort_keys=True) for job in jobs]
    distinct = list(dict.fromkeys(keys))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        input=json.dumps([json.loads(key) for key in distinct]),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sm_90 compile worker failed:\n{done.stderr[-4000:]}")
    results = dict(zip(distinct, json.loads(done.stdout)))
    return [results[key] for key in keys]


def assert_each_compiles_for_sm90(cases: list, jobs: list[dict], check: Callable[[object, dict], None]) -> None:
    """Compile each case's job for sm_90 (:func:`compile_sm90`) and ``check(case, result)`` each; fails naming every
    case that failed. One test per kernel module: its jobs are compiled by one pytest worker, not by each worker
    that would run a share of per-case tests."""
    failures = []
    for index, (case, result) in enumerate(zip(cases, compile_sm90(jobs), strict=True)):
        try:
            if not result["ok"]:
                raise AssertionError(result["error"])
            check(case, result)
        except AssertionError as failure:
            failures.append(f"job {index} {case}: {failure}")
    assert not failures, f"{len(failures)} of {len(jobs)} jobs failed:\n" + "\n".join(failures)


def launch_like(kernel, signature: dict, constexprs: dict, unit: tuple[str, ...] = ()) -> dict:
    """The fields of a compile job specialised as a typical launch is: the ``unit`` arguments (last-dim
    strides) become the constant 1, every pointer and every other ``stride_*`` argument is divisible by 16."""
    constexprs = {**constexprs, **{name: 1 for name in unit}}
    divisible = [
        name
        for name in kernel.arg_names
        if name not in constexprs and (signature.get(name, "").startswith("*") or name.startswith("stride_"))
    ]
    return dict(signature=signature, constexprs=constexprs, divisible=divisible)
