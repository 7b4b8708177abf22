"""``hfaccel bench attention``: causal prefill attention — hfaccel's flash kernel, torch SDPA (cuDNN / flash on
CUDA), and the path hfaccel's ``auto`` attention routes the call to (SDPA or the kernel, from the GPU's tuned
table) — in TFLOP/s, with the kernel configuration the call picked, and the kernel's bytes (Q, K, V read once, the
output written) over its time as a fraction of a read-only kernel's bandwidth (prefill is bound by compute at long
sequences; the fraction says how far from the memory bound a short one runs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from hfaccel.attention import KernelMask, prefill_route
from hfaccel.attention.functions import auto_attention
from hfaccel.kernels import flash_attention, resolve_backend
from hfaccel.kernels.flash_attention import attention_flops, pick_config
from hfaccel.tools.bench.timing import read_bandwidth, table, tensor_bytes, time_ms

# (batch, heads, kv_heads, seq, head_dim): Llama-3.1-8B and 3.2-1B heads (32 over 8, d 128 / 64), Gemma-2-2B's
# (8 over 4, d 256), a d-80 MHA model; S 1k-8k.
CUDA_GRID = [
    (4, 32, 8, 1024, 128),
    (2, 32, 8, 2048, 128),
    (1, 32, 8, 4096, 128),
    (1, 32, 8, 8192, 128),
    (4, 32, 8, 2048, 64),
    (1, 32, 8, 8192, 64),
    (2, 8, 4, 2048, 256),
    (1, 8, 4, 8192, 256),
    (1, 32, 32, 2048, 80),
]
CPU_GRID = [(1, 4, 2, 128, 64), (1, 4, 4, 256, 128)]
PLAIN_CAUSAL = KernelMask(key_mask=None, q_offset=0, kv_offset=0, causal=True, sliding_window=None)


@dataclass
class AttentionRow:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: str
    hfaccel_ms: float
    sdpa_ms: float
    hfaccel_tflops: float
    sdpa_tflops: float
    speedup: float  # sdpa time / hfaccel kernel time
    hfaccel_path: str  # the kernel's backend: triton, or the torch reference
    config: str  # the kernel's tiles (tuned table or heuristics)
    routed_path: str  # what hfaccel's "auto" attention runs for this call
    routed_ms: float
    routed_vs_sdpa: float  # sdpa time / routed time
    fraction_of_read: float  # the kernel's bytes (Q, K, V, output) / hfaccel_ms, over read_gb_per_s
    read_gb_per_s: float  # a read-only kernel's bandwidth


def bench_attention(grid, dtypes, device: torch.device) -> list[AttentionRow]:
    """Causal prefill attention on random inputs of each grid shape and dtype, in transformers' layout."""
    bandwidth = read_bandwidth(device)
    return [_row(*shape, dtype, device, bandwidth) for shape in grid for dtype in dtypes]


def _row(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    bandwidth: float,
) -> AttentionRow:
    def states(h):  # [B, H, S, D] views of [B, S, H, D] projections, as transformers passes them
        return torch.randn(batch, seq, h, head_dim, device=device, dtype=dtype).transpose(1, 2)

    q, k, v = states(heads), states(kv_heads), states(kv_heads)
    module = torch.nn.Module()
    ours = time_ms(lambda: flash_attention(q, k, v, causal=True), device)
    theirs = time_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads), device
    )
    routed = time_ms(lambda: auto_attention(module, q, k, v, PLAIN_CAUSAL), device)
    flops = attention_flops(batch, heads, seq, seq, head_dim, causal=True)
    moved = tensor_bytes([q, k, v]) + tensor_bytes([q])  # its output is the size of q
    cfg = pick_config(head_dim, dtype, seq, heads // kv_heads, device)
    return AttentionRow(
        batch,
        heads,
        kv_heads,
        seq,
        head_dim,
        str(dtype).removeprefix("torch."),
        ours,
        theirs,
        flops / ours / 1e9,
        flops / theirs / 1e9,
        theirs / ours,
        resolve_backend("auto", device),
        f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}{' tma' if cfg.tma else ''}",
        prefill_route("auto", q, k, PLAIN_CAUSAL, None),
        routed,
        theirs / routed,
        moved / ours / 1e6 / bandwidth,
        bandwidth,
    )


def run(options, console) -> dict:
    rows = [asdict(r) for r in bench_attention(CUDA_GRID if options.cuda else CPU_GRID, options.dtypes, options.device)]
    console.print(table("prefill attention (causal): hfaccel's kernel, torch SDPA, and the routed path", rows))
    return {"attention": rows}
