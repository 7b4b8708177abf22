"""``hfaccel bench serve``: throughput and latency of the HTTP server at concurrency 1, 8 and 64 (loopback).

Against a running server (``--url http://host:port/v1`` and its model name via ``--model``), or one this
command starts on a loopback port from a model folder (``--model``, default SmolLM2-135M-Instruct)
and stops afterwards. Each level sends ``max(16, 2 x concurrency)`` streaming completions of ``--new-tokens``
tokens through the official ``openai`` client (``hfaccel.tools.bench.loadgen``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

CONCURRENCY = (1, 8, 64)


def bench_serve(
    url: str | None,
    model: str | None,
    new_tokens: int,
    device: str = "auto",
    concurrency: tuple[int, ...] = CONCURRENCY,
) -> list[dict]:
    from hfaccel.tools.bench.loadgen import DEFAULT_PROMPTS, run_load

    server = None
    if url is None:
        server, url, name = _start_server(model, device)
    else:
        name = model or "default"
    try:
        rows = []
        for level in concurrency:
            _, summary = asyncio.run(run_load(url, name, DEFAULT_PROMPTS, max(16, 2 * level), level, new_tokens))
            rows.append(asdict(summary))
        return rows
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)


def _start_server(model: str | None, device: str):
    from hfaccel.serve.http import wait_until_serving
    from hfaccel.tools.assets import smollm2_path

    path = model or str(smollm2_path())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    with tempfile.NamedTemporaryFile("w", prefix="hfaccel-bench-serve-", suffix=".log") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hfaccel.tools.cli",
                "serve",
                path,
                "--port",
                "0",
                "--served-model-name",
                "bench",
                "--device",
                device,
                "--max-queue",
                "1024",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            return process, f"{wait_until_serving(process, Path(log.name), timeout=600)}/v1", "bench"
        except RuntimeError as error:
            process.kill()
            raise RuntimeError(f"the benchmark server for {path} did not start: {error}") from None


def run(options, console) -> dict:
    from hfaccel.tools.bench.timing import table

    rows = bench_serve(
        options.url, options.model, options.new_tokens or (128 if options.cuda else 16), str(options.device)
    )
    console.print(table("OpenAI-compatible server over loopback: streaming completions", rows))
    return {"serve": rows}
