"""``hfaccel bench``: figures and ratios against the baselines a user would otherwise pick, one module per case.

- attention: hfaccel's flash attention vs torch SDPA, and the path the router picks — causal prefill, TFLOP/s.
- paged: decode attention over the paged KV pool vs SDPA on contiguous K/V (eager and in a CUDA graph), against
  the read bandwidth.
- memory: bytes a mixed-length batch holds in PagedCache vs DynamicCache vs StaticCache.
- decode: ``generate`` tokens/s — transformers sdpa, static cache + torch.compile, hfaccel (paged / dense cache);
  with ``--profile``, hfaccel's decode step by kernel.
- engine: serving N requests — sequential / static-batch ``generate``, ``generate_batch``, ``hfaccel.Engine``;
  with ``--host``, the engine's host time per step split by part at batch 1, 64 and 256.
- serve: the OpenAI-compatible server at concurrency 1, 8, 64 over loopback (not part of "all").
- speculative: ``speculative_generate`` against the accelerated target alone, with acceptance and cost ratio.
- int4: the W4A16 op vs cuBLAS (and dequantize + cuBLAS) at Llama-3.1-8B shapes, and int4 vs dense decode
  tokens/s of an accelerated model (not part of "all": it builds a Llama-3.1-8B-shaped model on CUDA).
- fp8: fp8 weights (e4m3, weight-only) — the op vs cuBLAS at Llama-3.1-8B shapes, and fp8 vs 16-bit decode
  tokens/s of an accelerated model (not part of "all": it builds a Llama-3.1-8B-shaped model on CUDA).
- structured: structured outputs — the host's mask time per token (p50 / p99) over real constrained generations,
  and Engine throughput with 0%, 50% and 100% structured requests (not part of "all": it needs xgrammar, the
  ``hfaccel[structured]`` extra, and SmolLM2's tokenizer).
- vlm: a vision-language model (Qwen2.5-VL-3B-shaped, one 448×448 image per prompt): batch-1 decode after the prompt
  against transformers' paths, and ``hfaccel.Engine`` serving image requests against transformers' padded batches
  (not part of "all": it builds a 3.8B-parameter model).
- lora: serving LoRA adapters — Engine output tokens/s of a batch on the base model (no LoRA engine), on the LoRA
  engine with base requests, one adapter and 8 adapters mixed, and the LoRA kernels' time per decode step against
  the base step (not part of "all": it makes its adapters with peft, a dev dependency).

Benchmarks are not tests: nothing here asserts a speed. Results print as tables and are written as JSON.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from rich.console import Console

from hfaccel.tools.bench.timing import environment

# case -> module of hfaccel.tools.bench with ``run(options, console) -> dict`` (result sections)
CASES = (
    "attention",
    "paged",
    "memory",
    "decode",
    "engine",
    "speculative",
    "int4",
    "fp8",
    "serve",
    "structured",
    "lora",
    "vlm",
)
NOT_IN_ALL = ("int4", "fp8", "serve", "structured", "lora", "vlm")  # int4, fp8, vlm build multi-billion models;
# serve starts (or needs) a server; structured needs the optional xgrammar; lora makes its adapters with peft (a dev
# dependency)


@dataclass
class BenchOptions:
    """What the ``hfaccel bench`` flags chose, shared by every case."""

    device: torch.device
    dtypes: list[torch.dtype]
    model: str | None = None
    batches: list[int] | None = None
    prompt_len: int | None = None
    new_tokens: int | None = None
    draft: str = "int4"
    num_draft_tokens: int = 4
    num_requests: int | None = None
    url: str | None = None
    host: bool = False  # engine: the host time per step, split by part, instead of the serving comparison
    tokenizer: str | None = None  # structured: the tokenizer folder of a named config (default: SmolLM2's)
    tensor_parallel_size: int = 1  # engine: serve over this many ranks and report the all-reduce share
    profile: bool = False  # decode: also hfaccel's decode step by kernel
    layers: int | None = None  # decode: a named config with this many layers (its layer shapes kept)
    kv_cache_dtype: str | None = None  # engine: one more engine, its KV pool in this dtype (same memory)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def run_bench(
    what: str | list[str] = "all",
    model: str | None = None,
    device: str = "auto",
    dtypes: list[str] | None = None,
    batches: list[int] | None = None,
    prompt_len: int | None = None,
    new_tokens: int | None = None,
    output: str | None = None,
    console: Console | None = None,
    draft: str = "int4",
    num_draft_tokens: int = 4,
    num_requests: int | None = None,
    url: str | None = None,
    host: bool = False,
    tokenizer: str | None = None,
    tensor_parallel_size: int = 1,
    profile: bool = False,
    layers: int | None = None,
    kv_cache_dtype: str | None = None,
) -> dict:
    """Run the selected benchmarks (one name, a list, or "all"), print tables, write JSON; returns the results."""
    chosen = {what} if isinstance(what, str) else set(what)
    unknown = sorted(chosen - set(CASES) - {"all"})
    if unknown:
        raise ValueError(f"unknown bench case(s) {unknown}; choose from {', '.join(('all',) + CASES)}")
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    names = dtypes or (["float16", "bfloat16"] if dev.type == "cuda" else ["float32"])
    options = BenchOptions(
        dev,
        [getattr(torch, d) for d in names],
        model,
        batches,
        prompt_len,
        new_tokens,
        draft,
        num_draft_tokens,
        num_requests,
        url,
        host,
        tokenizer,
        tensor_parallel_size,
        profile,
        layers,
        kv_cache_dtype,
    )
    results = {"environment": environment(dev)}
    for case in CASES:
        if case in chosen or ("all" in chosen and case not in NOT_IN_ALL):
            results.update(importlib.import_module(f"hfaccel.tools.bench.{case}").run(options, console))
    path = Path(output or f"bench-results/bench-{datetime.now():%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {path}")
    return results
