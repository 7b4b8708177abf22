"""``hfaccel bench memory``: the KV memory ``generate()`` actually allocates for a left-padded batch of prompts of
mixed lengths — transformers' DynamicCache and StaticCache (the caches its generate returns) against an
accelerated model (the pool of hfaccel's decode loop: bytes allocated, and the most it held at once) — next to
the bytes the real tokens need. Accounting of what was allocated, not a timing."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hfaccel import compat
from hfaccel.hf import accelerate, restore
from hfaccel.kernels.runtime import triton_can_run
from hfaccel.tools.bench.timing import table, tensor_bytes
from hfaccel.tools.models import build_model

LENGTHS = [400, 650, 900, 1300, 1800, 2400, 3100, 4000]  # prompt lengths of the batch (CUDA)
CPU_LENGTHS = [40, 65, 90, 130, 180, 240, 310, 400]  # the same mix, smaller, for a CPU run
NEW_TOKENS = 16


@dataclass
class MemoryRow:
    cache: str
    bytes: int
    vs_real_tokens: float  # bytes / the bytes the real tokens (prompts + outputs, no padding) need


def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token across all layers."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize


def _cache_bytes(cache) -> int:
    """Bytes of the K/V tensors a transformers cache allocated."""
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


def _padded_batch(lengths: list[int], vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)
    ids = torch.randint(3, vocab, (len(lengths), width), device=device) * mask
    return {"input_ids": ids, "attention_mask": mask}


def memory_comparison(model, lengths: list[int], new_tokens: int = NEW_TOKENS) -> list[MemoryRow]:
    """Bytes of KV memory each generate() path allocates for prompts of ``lengths`` and ``new_tokens`` each."""
    batch = _padded_batch(lengths, model.config.vocab_size, model.device)
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    real = (sum(lengths) + len(lengths) * new_tokens) * kv_bytes_per_token(model)
    rows = [MemoryRow("real tokens (no padding)", real, 1.0)]
    restore(model)
    for name, extra in (
        ("transformers DynamicCache", {}),
        ("transformers StaticCache", {"cache_implementation": "static"}),
    ):
        out = model.generate(**batch, return_dict_in_generate=True, **args, **extra)
        rows.append(MemoryRow(name, _cache_bytes(compat.output_cache(out)), 0.0))
        del out
    # hfaccel's loop and pool: where its kernels do not run, "auto" leaves generate() to transformers' loop
    accelerate(model, attention="auto" if triton_can_run(model.device) else "torch")
    model.generate(**batch, **args)
    pool = model.hfaccel.session.runner.pool
    peak = pool.manager.peak_used_blocks * pool.block_bytes()
    rows += [
        MemoryRow("hfaccel pool allocated", tensor_bytes(pool.memory_tensors()), 0.0),
        MemoryRow("hfaccel pool held at most", peak, 0.0),
    ]
    restore(model)
    for row in rows:
        row.vs_real_tokens = row.bytes / real
    return rows


def run(options, console) -> dict:
    spec = options.model or ("llama-3.2-1b" if options.cuda else "tiny-llama")
    model = build_model(spec, options.device, options.dtypes[0])
    lengths = LENGTHS if options.cuda else CPU_LENGTHS
    if options.prompt_len:  # the same mix, its longest prompt this long
        lengths = [max(1, n * options.prompt_len // max(lengths)) for n in lengths]
    rows = [asdict(r) for r in memory_comparison(model, lengths)]
    console.print(
        table(
            f"KV memory generate() allocates, {spec} {options.dtypes[0]}, prompts {lengths} + "
            f"{NEW_TOKENS} new tokens each",
            rows,
        )
    )
    return {"memory": rows}
