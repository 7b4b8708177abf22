"""``hfaccel bench memory``: bytes a batch of mixed-length sequences holds in PagedCache vs DynamicCache vs
StaticCache."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hfaccel.kv import BlockManager
from hfaccel.tools.bench.timing import table
from hfaccel.tools.models import NAMED_CONFIGS

LENGTHS = [400, 650, 900, 1300, 1800, 2400, 3100, 4000]  # a mixed batch of prompts + generations


@dataclass
class MemoryRow:
    cache: str
    bytes: int
    vs_paged: float


def memory_comparison(spec: str, lengths: list[int], dtype: torch.dtype, block_size: int = 16) -> list[MemoryRow]:
    """Bytes each cache holds for sequences of ``lengths`` (K and V, all layers), from the caches' layouts.

    DynamicCache pads every row to the longest; StaticCache preallocates every row to ``max_cache_len``
    (here the longest length); PagedCache allocates whole blocks per sequence (block manager accounting).
    """
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


def run(options, console) -> dict:
    spec = options.model if options.model in NAMED_CONFIGS else "llama-3.2-1b"
    rows = [asdict(r) for r in memory_comparison(spec, LENGTHS, torch.float16)]
    console.print(table(f"KV cache bytes, {spec} fp16, lengths {LENGTHS}", rows))
    return {"memory": rows}
