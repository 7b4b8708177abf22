"""``hfaccel bench decode``: ``generate`` tokens/s — transformers sdpa (eager), transformers static cache +
torch.compile (CUDA only), ``hfaccel.accelerate`` with its paged cache, and with transformers' dense cache
(``paged=False``) — on a model built from a named real config with random weights (speed does not depend on the
weights' values), or a local model folder."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from hfaccel.hf import accelerate, restore
from hfaccel.tools.bench.timing import sync, table
from hfaccel.tools.models import build_model


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


def timed_generate(model, input_ids: torch.Tensor, new_tokens: int, **kwargs) -> float:
    """Seconds of one greedy ``generate`` of exactly ``new_tokens`` tokens, after warm-up runs."""
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, **kwargs)
    model.generate(input_ids, **{**args, "max_new_tokens": min(new_tokens, 8),
                                 "min_new_tokens": min(new_tokens, 8)})  # warm-up (and compile)
    if input_ids.is_cuda:
        model.generate(input_ids, **args)  # second warm-up: static-cache compile settles here
    sync(input_ids.device)
    start = time.perf_counter()
    model.generate(input_ids, **args)
    sync(input_ids.device)
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
                accelerate(model, paged=path == "hfaccel")
            if path == "transformers static+compile":
                kwargs = dict(cache_implementation="static", compile_config=CompileConfig())
            seconds = timed_generate(model, input_ids, new_tokens, **kwargs)
            restore(model)
            tokens_per_s = batch * new_tokens / seconds
            baseline = baseline or tokens_per_s
            rows.append(DecodeRow(spec, path, batch, prompt_len, new_tokens, seconds, tokens_per_s,
                                  tokens_per_s / baseline))
    return rows


def run(options, console) -> dict:
    rows = bench_decode(options.model or ("llama-3.2-1b" if options.cuda else "tiny-llama"), options.batches or [1, 16],
                        options.prompt_len or (128 if options.cuda else 32),
                        options.new_tokens or (128 if options.cuda else 16), options.device, options.dtypes[0])
    rows = [asdict(r) for r in rows]
    console.print(table("decode: generate() tokens/s", rows))
    return {"decode": rows}
