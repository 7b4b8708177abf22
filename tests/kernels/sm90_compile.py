"""Worker for tests.kernels.helpers.compile_sm90: reads jobs as JSON on stdin, prints results as JSON.

Runs without TRITON_INTERPRET so the kernels are real JITFunctions; compiles with two processes.
"""

import importlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_job(job: dict) -> dict:
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    constexprs = job["constexprs"]
    signature = {
        name: "constexpr" if name in constexprs else job["signature"].get(name, "constexpr")
        for name in kernel.arg_names
    }
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constexprs]
    if missing:
        return {"ok": False, "error": f"no type or constexpr value given for {missing}"}
    # what a launch tells the compiler about arguments divisible by 16 (pointers, strides): it pipelines with it
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in job.get("divisible", ())}
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]},
        )
    except Exception as exc:  # noqa: BLE001 - reported back to the test, which fails on it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ptx = compiled.asm["ptx"]
    return {
        "ok": True,
        "shared": compiled.metadata.shared,
        "ptx_counts": {pattern: ptx.count(pattern) for pattern in job.get("ptx_patterns", ())},
    }


def main() -> None:
    jobs = json.load(sys.stdin)
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_job, jobs))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
