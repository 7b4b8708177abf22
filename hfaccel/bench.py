"""``hfaccel bench``: figures and ratios against the baselines a user would otherwise pick.

- attention: hfaccel's flash attention vs torch SDPA (its flash backend on CUDA) — prefill, causal, TFLOP/s.
- paged: decode attention over the paged KV pool — GB/s of K/V read against the measured copy bandwidth,
  and time against torch SDPA reading the same K/V held contiguously, context 1k–32k, batch 1–64.
- memory: bytes a batch of mixed-length sequences holds in PagedCache vs DynamicCache vs StaticCache.
- decode: ``generate`` tokens/s — transformers sdpa (eager), transformers static cache + torch.compile (CUDA
  only), ``hfaccel.accelerate`` with its paged cache, and with transformers' dense cache (``paged=False``) —
  on a model built from a named real config with random weights (speed does not depend on the weights'
  values), or a local model folder.
- engine: serving N requests — sequential / static-batch ``generate``, transformers' ``generate_batch`` and
  ``hfaccel.Engine``: throughput, TTFT and inter-token latency (``hfaccel.bench_engine``).
- serve: the OpenAI-compatible server at concurrency 1, 8, 64 over loopback (``hfaccel.bench_serve``).
- speculative: ``speculative_generate`` against the accelerated target alone, with measured acceptance and
  cost ratio next to the analytic expectation (``hfaccel.bench_speculative``).

Benchmarks are not tests: nothing here asserts a speed. Results print as tables and are written as JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import hfaccel
from hfaccel.kernels import flash_attention, resolve_backend
from hfaccel.kernels.flash_attention import attention_flops
from hfaccel.kernels.paged_attention import paged_attention

# Shapes of public checkpoints (their config.json values), for random-weight models of the real size.
NAMED_CONFIGS: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "tiny-llama": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                       max_position_embeddings=2048),
}

# (batch, heads, seq, head_dim) of the prefill attention grid.
CUDA_ATTENTION_GRID = [(4, 32, 1024, 128), (2, 32, 2048, 128), (1, 32, 4096, 128), (1, 32, 8192, 128),
                       (4, 32, 2048, 64), (1, 16, 2048, 256), (1, 32, 2048, 80)]
CPU_ATTENTION_GRID = [(1, 4, 128, 64), (1, 4, 256, 128)]
# (batch, context) of the paged decode grid; heads 32 over 8 KV heads, head_dim 128 (Llama-3-8B shapes).
CUDA_PAGED_GRID = [(b, c) for c in (1024, 4096, 16384, 32768) for b in (1, 8, 64)]
CPU_PAGED_GRID = [(1, 128), (2, 256)]
MEMORY_LENGTHS = [400, 650, 900, 1300, 1800, 2400, 3100, 4000]  # a mixed batch of prompts + generations


@dataclass
class AttentionRow:
    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    hfaccel_ms: float
    sdpa_ms: float
    hfaccel_tflops: float
    sdpa_tflops: float
    speedup: float  # sdpa time / hfaccel time
    hfaccel_path: str


@dataclass
class PagedRow:
    batch: int
    context: int
    dtype: str
    hfaccel_ms: float
    sdpa_ms: float
    kv_gb_per_s: float
    copy_gb_per_s: float
    fraction_of_copy: float  # K/V read bandwidth / measured copy bandwidth
    speedup: float  # sdpa (contiguous K/V) time / hfaccel paged time


@dataclass
class MemoryRow:
    cache: str
    bytes: int
    vs_paged: float


@dataclass
class DecodeRow:
    model: str
    path: str
    batch: int
    prompt_len: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # vs transformers sdpa at the same batch


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA, wall clock over ``reps`` runs elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_attention(grid, dtypes, device: torch.device) -> list[AttentionRow]:
    """Causal prefill attention, hfaccel vs torch SDPA, on random inputs of each grid shape and dtype."""
    return [_attention_row(*shape, dtype, device) for shape in grid for dtype in dtypes]


def _attention_row(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> AttentionRow:
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3))
    ours = time_ms(lambda: flash_attention(q, k, v, causal=True), device)
    theirs = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal=True)
    return AttentionRow(batch, heads, seq, head_dim, str(dtype).removeprefix("torch."), ours, theirs,
                        flops / ours / 1e9, flops / theirs / 1e9, theirs / ours, resolve_backend("auto", device))


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy (bytes read + written), the practical roofline of a memory-bound kernel."""
    numel = (256 << 20) if device.type == "cuda" else (16 << 20)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / time_ms(lambda: dst.copy_(src), device) / 1e6


def bench_paged(grid, dtype: torch.dtype, device: torch.device, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128, block_size: int = 16) -> list[PagedRow]:
    """One decode step of attention over the paged pool (shuffled blocks) vs SDPA on contiguous K/V."""
    copy = copy_bandwidth(device)
    shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    return [_paged_row(batch, context, dtype, device, copy, **shapes) for batch, context in grid]


def _paged_row(batch: int, context: int, dtype: torch.dtype, device: torch.device, copy: float, *, heads: int,
               kv_heads: int, head_dim: int, block_size: int) -> PagedRow:
    blocks = batch * -(-context // block_size)
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()  # shuffled, as a live pool is
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
    ours = time_ms(lambda: paged_attention(q, pool[0], pool[1], tables, lens, max_seqlen_k=context), device)
    k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    theirs = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device)
    gb_per_s = 2 * batch * context * kv_heads * head_dim * q.element_size() / ours / 1e6
    return PagedRow(batch, context, str(dtype).removeprefix("torch."), ours, theirs, gb_per_s, copy,
                    gb_per_s / copy, theirs / ours)


def memory_comparison(spec: str, lengths: list[int], dtype: torch.dtype, block_size: int = 16) -> list[MemoryRow]:
    """Bytes each cache holds for sequences of ``lengths`` (K and V, all layers), from the caches' layouts.

    DynamicCache pads every row to the longest; StaticCache preallocates every row to ``max_cache_len``
    (here the longest length); PagedCache allocates whole blocks per sequence (block manager accounting).
    """
    from hfaccel.block_manager import BlockManager

    fields = NAMED_CONFIGS[spec]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    per_token = 2 * fields["num_hidden_layers"] * fields["num_key_value_heads"] * head_dim * dtype.itemsize
    manager = BlockManager(sum(-(-n // block_size) for n in lengths), block_size, enable_prefix_caching=False)
    for seq_id, length in enumerate(lengths):
        manager.add_sequence(seq_id, num_tokens=length)
    paged = manager.num_used_blocks * block_size * per_token
    dynamic = len(lengths) * max(lengths) * per_token
    return [MemoryRow("PagedCache", paged, 1.0), MemoryRow("DynamicCache", dynamic, dynamic / paged),
            MemoryRow("StaticCache", dynamic, dynamic / paged),
            MemoryRow("tokens held (lower bound)", sum(lengths) * per_token, sum(lengths) / (paged / per_token))]


def build_model(spec: str, device: torch.device, dtype: torch.dtype):
    """A random-weight model of a named config's shapes, or the model in a local folder / hub id."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec in NAMED_CONFIGS:
        fields = dict(NAMED_CONFIGS[spec])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    elif Path(spec).exists() or "/" in spec:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        raise ValueError(f"model must be one of {sorted(NAMED_CONFIGS)} or a model folder / hub id; got {spec!r}")
    return model.eval()


def _timed_generate(model, input_ids: torch.Tensor, new_tokens: int, **kwargs) -> float:
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, **kwargs)
    model.generate(input_ids, **{**args, "max_new_tokens": min(new_tokens, 8),
                                 "min_new_tokens": min(new_tokens, 8)})  # warm-up (and compile)
    if input_ids.is_cuda:
        model.generate(input_ids, **args)  # second warm-up: static-cache compile settles here
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids, **args)
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_paths(device: torch.device) -> list[str]:
    paths = ["transformers sdpa"]
    if device.type == "cuda":
        paths.append("transformers static+compile")
    return paths + ["hfaccel", "hfaccel paged=False"]


def bench_decode(spec: str, batches, prompt_len: int, new_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> list[DecodeRow]:
    """generate() tokens/s of each path at each batch size (greedy, fixed length, random prompts)."""
    from transformers import CompileConfig

    model = build_model(spec, device, dtype)
    rows = []
    for batch in batches:
        input_ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=device)
        baseline = None
        for path in decode_paths(device):
            kwargs = {}
            if path.startswith("hfaccel"):
                hfaccel.accelerate(model, paged=path == "hfaccel")
            if path == "transformers static+compile":
                kwargs = dict(cache_implementation="static", compile_config=CompileConfig())
            seconds = _timed_generate(model, input_ids, new_tokens, **kwargs)
            hfaccel.restore(model)
            tokens_per_s = batch * new_tokens / seconds
            baseline = baseline or tokens_per_s
            rows.append(DecodeRow(spec, path, batch, prompt_len, new_tokens, seconds, tokens_per_s,
                                  tokens_per_s / baseline))
    return rows


def environment(device: torch.device) -> dict:
    import transformers
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
        "hfaccel": hfaccel.__version__, "commit": commit or None, "command": " ".join(sys.argv),
    }


def run_bench(what: str | list[str] = "all", model: str | None = None, device: str = "auto", dtypes: list[str] | None = None,
              batches: list[int] | None = None, prompt_len: int | None = None, new_tokens: int | None = None,
              output: str | None = None, console: Console | None = None, draft: str = "int4",
              num_draft_tokens: int = 4, num_requests: int | None = None, url: str | None = None) -> dict:
    """Run the selected benchmarks (one name, a list, or "all"), print tables, write JSON; returns the results."""
    chosen = {what} if isinstance(what, str) else set(what)
    wanted = lambda case: "all" in chosen or case in chosen  # noqa: E731
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype_objs = [getattr(torch, d) for d in (dtypes or (["float16", "bfloat16"] if cuda else ["float32"]))]
    results = {"environment": environment(dev)}
    if wanted("attention"):
        rows = bench_attention(CUDA_ATTENTION_GRID if cuda else CPU_ATTENTION_GRID, dtype_objs, dev)
        results["attention"] = [asdict(r) for r in rows]
        console.print(_table("prefill attention (causal): hfaccel vs torch SDPA", results["attention"]))
    if wanted("paged"):
        shapes = {} if cuda else dict(heads=8, kv_heads=2, head_dim=64)
        rows = bench_paged(CUDA_PAGED_GRID if cuda else CPU_PAGED_GRID, dtype_objs[0], dev, **shapes)
        results["paged"] = [asdict(r) for r in rows]
        console.print(_table("paged decode attention: hfaccel (paged pool) vs SDPA (contiguous K/V)",
                             results["paged"]))
    if wanted("memory"):
        spec = model if model in NAMED_CONFIGS else "llama-3.2-1b"
        results["memory"] = [asdict(r) for r in memory_comparison(spec, MEMORY_LENGTHS, torch.float16)]
        console.print(_table(f"KV cache bytes, {spec} fp16, lengths {MEMORY_LENGTHS}", results["memory"]))
    if wanted("decode"):
        rows = bench_decode(model or ("llama-3.2-1b" if cuda else "tiny-llama"), batches or [1, 16],
                            prompt_len or (128 if cuda else 32), new_tokens or (128 if cuda else 16), dev,
                            dtype_objs[0])
        results["decode"] = [asdict(r) for r in rows]
        console.print(_table("decode: generate() tokens/s", results["decode"]))
    if wanted("engine"):
        results.update(_engine_tables(model, dev, dtype_objs[0], console, num_requests))
    if "serve" in chosen:  # not part of "all": it starts (or needs) a server
        from hfaccel.bench_serve import bench_serve

        results["serve"] = bench_serve(url, model, new_tokens or (128 if cuda else 16), device)
        console.print(_table("OpenAI-compatible server over loopback: streaming completions", results["serve"]))
    if wanted("speculative"):
        from hfaccel.bench_speculative import bench_speculative

        spec_model = model if model is not None and model not in NAMED_CONFIGS else None
        rows = bench_speculative(spec_model, draft, batches or [1, 4, 16], num_draft_tokens,
                                 prompt_len or (128 if cuda else 32), new_tokens or (128 if cuda else 16), dev,
                                 dtype_objs[0])
        results["speculative"] = [asdict(r) for r in rows]
        console.print(_table(f"speculative decoding (draft {draft}, k={num_draft_tokens}) vs the target alone",
                             results["speculative"]))
    path = Path(output or f"bench-results/bench-{datetime.now():%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {path}")
    return results


def _engine_tables(model: str | None, device: torch.device, dtype: torch.dtype, console: Console,
                   num_requests: int | None) -> dict:
    from hfaccel.bench_engine import bench_engine, make_workload

    cuda = device.type == "cuda"
    spec = model or ("llama-3.2-1b" if cuda else "tiny-llama")
    net = build_model(spec, device, dtype)
    count = num_requests or (256 if cuda else 32)
    work = make_workload(count, (16, 512) if cuda else (8, 64), (16, 256) if cuda else (4, 32),
                         net.config.vocab_size)
    rows, decode = bench_engine(net, work, device, max_num_seqs=64 if cuda else 16,
                                max_num_batched_tokens=4096 if cuda else 512)
    serving, steps = [asdict(r) for r in rows], [asdict(r) for r in decode]
    console.print(_table(f"serving {count} requests, {spec}: output tokens/s and latency", serving))
    console.print(_table(f"engine decode step vs reading the weights once ({spec})", steps))
    return {"engine": serving, "engine_decode_step": steps}


def _table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="left" if isinstance(rows[0][key], str) else "right")
    for row in rows:
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    return table
