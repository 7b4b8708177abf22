"""``hfaccel bench lora``: what serving LoRA adapters (``Engine(..., lora_adapters=...)``) costs in decode throughput.

:data:`ADAPTERS` random rank-:data:`RANK` adapters of the model (every attention and MLP projection, made with PEFT
into a temporary folder, as ``save_pretrained`` writes them) are served by an engine whose slot pool holds them all
(``max_loras`` = :data:`ADAPTERS`, ``max_lora_rank`` = :data:`RANK`). One batch of requests (fixed prompt length,
greedy, ``ignore_eos``: every run produces the same tokens) is served

1. by an engine of the base model without LoRA (the baseline),
2. by the LoRA engine, every request on the base model (the wrapped layers take the variant without LoRA ops),
3. by the LoRA engine, every request on one adapter,
4. by the LoRA engine, the requests spread over all the adapters (request ``i`` on adapter ``i % ADAPTERS``),

reporting output tokens/s, its ratio to (1), and the wall time per engine step (the step's share of one prefill
step included). Each path runs once to warm up, then twice in the order 1 2 3 4 4 3 2 1; the median (the lower) of
its two timed runs is reported. Goal on a GPU (issue 32): (4) with 8 rank-16 adapters in a batch of 64 at
≥ 0.8× (1).

A second table times the LoRA kernels of one decode step — ``lora_apply`` of every wrapped layer (what the layer runs:
one fused launch at a decode batch), and beside it ``lora_shrink`` and ``lora_expand`` (the two-launch path, for
comparison), on the engine's own slot pools, ``batch`` rows spread over all the slots — against the base model's
engine step (seconds / steps of run 1). On CUDA the kernels are replayed from a CUDA graph (the GPU time a captured
decode step pays, timed with CUDA events); off CUDA they run the torch reference (one matmul per slot present), timed
with ``perf_counter``.
"""

from __future__ import annotations

import gc
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hfaccel.engine import Engine
from hfaccel.hf import accelerate, restore
from hfaccel.kernels.lora import lora_apply, lora_expand, lora_shrink
from hfaccel.lora import DEFAULT_TARGET_MODULES
from hfaccel.sampling import SamplingParams
from hfaccel.tools.bench.engine import make_workload
from hfaccel.tools.bench.timing import graph_time_ms, median_run, sync, table
from hfaccel.tools.models import build_model

ADAPTERS = 8
RANK = 16
TARGETS = DEFAULT_TARGET_MODULES  # q, k, v, o, gate, up, down
BASE, LORA_BASE, ONE, MIXED = (
    "base model, no LoRA engine",
    "LoRA engine, base requests",
    "LoRA engine, 1 adapter",
    f"LoRA engine, {ADAPTERS} adapters mixed",
)


@dataclass
class ThroughputRow:
    path: str
    adapters: int  # distinct adapters among the requests
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    vs_base: float | None
    steps: int
    step_ms: float  # wall time per engine step


@dataclass
class KernelRow:
    layers: str  # the module name ending, or "all" (every wrapped layer of one decode step, timed in one call)
    count: int  # wrapped layers of that kind
    k: int | None
    n: int | None
    apply_us: float | None  # one layer's lora_apply (what the layer runs)
    shrink_us: float | None  # one layer's lora_shrink (the two-launch path, for comparison)
    expand_us: float | None  # one layer's lora_expand
    ms_per_step: float  # count x apply; "all": measured
    base_step_ms: float  # the base model's engine step (run 1: seconds / steps)
    vs_base_step: float  # ms_per_step / base_step_ms


def make_adapters(
    model: torch.nn.Module, folder: Path, count: int = ADAPTERS, rank: int = RANK, targets=TARGETS
) -> dict[str, str]:
    """``count`` random PEFT LoRA adapters of ``model`` (``init_lora_weights=False``: A and B random, B scaled
    down so that the updates stay small) saved under ``folder``; ``{name: path}``. The model is given back as it
    came (PEFT's layers unloaded, its parameters' ``requires_grad`` restored)."""
    from peft import LoraConfig, get_peft_model

    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations inside PEFT and transformers
        for i in range(count):
            torch.manual_seed(1000 + i)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
            peft_model = get_peft_model(model, config)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_B" in name:
                        param.mul_(0.1)
            paths[f"adapter-{i}"] = str(folder / f"adapter-{i}")
            peft_model.save_pretrained(paths[f"adapter-{i}"])
            model = peft_model.unload()
    for name, p in model.named_parameters():
        p.requires_grad_(grads.get(name, p.requires_grad))
    return paths


def _serve(engine: Engine, prompts: list[list[int]], new_tokens: int, path: str, loras) -> ThroughputRow:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    device = engine.runner.device
    steps = engine.host_times.steps
    sync(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, lora=loras)
    sync(device)
    seconds = time.perf_counter() - start
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} requests failed ({path}): {failed[0]}")
    steps = engine.host_times.steps - steps
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    distinct = len({name for name in (loras if isinstance(loras, list) else [loras]) if name is not None})
    return ThroughputRow(
        path, distinct, len(prompts), produced, seconds, produced / seconds, None, steps, seconds * 1e3 / max(steps, 1)
    )


def bench_throughput(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    adapters: dict[str, str],
    *,
    max_loras: int = ADAPTERS,
    max_rank: int = RANK,
):
    """The four rows (base engine; LoRA engine with base requests, one adapter, all adapters mixed), the LoRA
    engine's wrapped layers by name (their slot pools, for :func:`bench_kernels`) and its kernels' backend. Warm-up
    runs first, then A B C D D C B A; the LoRA engine is closed before the baseline's second run (the model's own
    layers back)."""
    batch = len(prompts)
    longest = max(map(len, prompts)) + new_tokens + 1
    settings = {
        "max_num_seqs": batch,
        "num_blocks": batch * -(-longest // 16) + 8,
        "block_size": 16,
        "max_num_batched_tokens": max(512, sum(map(len, prompts))),
        "enable_prefix_caching": False,
    }
    names = sorted(adapters, key=lambda n: int(n.rsplit("-", 1)[1]))
    loras = {LORA_BASE: None, ONE: names[0], MIXED: [names[i % len(names)] for i in range(batch)]}
    base = Engine(model, **settings)  # before the LoRA engine wraps the model's layers
    _serve(base, prompts, new_tokens, BASE, None)  # warm-up
    timed = {BASE: [_serve(base, prompts, new_tokens, BASE, None)]}
    engine = Engine(model, lora_adapters=adapters, max_loras=max_loras, max_lora_rank=max_rank, **settings)
    for path, names_of in loras.items():  # warm-up (on CUDA: both decode-step variants compiled and captured)
        _serve(engine, prompts, new_tokens, path, names_of)
    for path in list(loras) + list(loras)[::-1]:
        timed.setdefault(path, []).append(_serve(engine, prompts, new_tokens, path, loras[path]))
    layers, backend = dict(engine.loras.layers), engine.loras.context.backend  # the pools outlive the engine here
    engine.close()  # the model's own layers back for the baseline's second run
    del engine
    gc.collect()
    timed[BASE].append(_serve(base, prompts, new_tokens, BASE, None))
    base.close()
    rows = [median_run(runs, speed=lambda row: row.tokens_per_s) for runs in timed.values()]
    for row in rows:
        row.vs_base = row.tokens_per_s / rows[0].tokens_per_s
    return rows, layers, backend


def bench_kernels(layers: dict, backend: str, batch: int, base_step_ms: float) -> list[KernelRow]:
    """Time one decode step's LoRA kernels on the LoRA layers' slot pools (``layers``: name -> LoRALinear):
    ``batch`` rows, row ``t`` on slot ``t % max_loras``; per kind of layer (one layer's ``lora_apply`` times the
    layers of that kind; its shrink and expand beside it) and for every wrapped layer in one call ("all")."""
    first = next(iter(layers.values()))
    device, dtype = first.lora_a.device, first.lora_a.dtype
    slots = first.lora_a.shape[0]
    index = torch.arange(batch, device=device) % slots
    present = list(range(min(slots, batch)))
    generator = torch.Generator(device="cpu").manual_seed(0)
    inputs = {}  # (k, n) -> (x [B, K], y [B, N], v [B, R])
    for layer in layers.values():
        key = (layer.in_features, layer.out_features)
        if key not in inputs:
            x = torch.randn(batch, key[0], generator=generator).to(device, dtype)
            y = torch.randn(batch, key[1], generator=generator).to(device, dtype)
            inputs[key] = (x, y, lora_shrink(x, layer.lora_a, index, slots=present, backend=backend))

    def shrink(layer):
        x, _, _ = inputs[layer.in_features, layer.out_features]
        return lambda: lora_shrink(x, layer.lora_a, index, slots=present, backend=backend)

    def expand(layer):
        _, y, v = inputs[layer.in_features, layer.out_features]
        return lambda: lora_expand(y, v, layer.lora_b, index, slots=present, backend=backend)

    def apply(layer):
        x, y, _ = inputs[layer.in_features, layer.out_features]
        return lambda: lora_apply(x, y, layer.lora_a, layer.lora_b, index, slots=present, backend=backend)

    def step():
        for layer in layers.values():
            apply(layer)()

    kinds: dict[str, list] = {}
    order = {kind: i for i, kind in enumerate(TARGETS)}
    for name in sorted(layers, key=lambda name: (order.get(name.rsplit(".", 1)[-1], len(order)), name)):
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(layers[name])
    rows = []
    for kind, group in kinds.items():
        layer = group[0]
        apply_ms = graph_time_ms(apply(layer), device)
        shrink_ms, expand_ms = graph_time_ms(shrink(layer), device), graph_time_ms(expand(layer), device)
        per_step = len(group) * apply_ms
        rows.append(
            KernelRow(
                kind,
                len(group),
                layer.in_features,
                layer.out_features,
                apply_ms * 1e3,
                shrink_ms * 1e3,
                expand_ms * 1e3,
                per_step,
                base_step_ms,
                per_step / base_step_ms,
            )
        )
    sync(device)
    total = graph_time_ms(step, device)
    rows.append(KernelRow("all", len(layers), None, None, None, None, None, total, base_step_ms, total / base_step_ms))
    return rows


def run(options, console) -> dict:
    device, dtype = options.device, options.dtypes[0]
    spec = options.model or ("llama-3.2-1b" if options.cuda else "tiny-llama")
    batch = (options.batches or [64 if options.cuda else 16])[0]
    prompt_len = options.prompt_len or (32 if options.cuda else 16)
    new_tokens = options.new_tokens or (128 if options.cuda else 32)
    model = build_model(spec, device, dtype)
    work = make_workload(batch, (prompt_len, prompt_len), (new_tokens, new_tokens), model.config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="hfaccel-bench-lora-") as folder:
        adapters = make_adapters(model, Path(folder))
        accelerate(model, paged=False)
        rows, layers, backend = bench_throughput(model, work.prompts, new_tokens, adapters)
    kernels_path = (
        "Triton kernels, CUDA-graph replay"
        if device.type == "cuda"
        else f"torch reference on {device.type} (no Triton kernels off CUDA)"
    )
    config = {
        "model": spec,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "adapters": ADAPTERS,
        "rank": RANK,
        "targets": list(TARGETS),
        "max_loras": ADAPTERS,
        "max_lora_rank": RANK,
        "backend": backend,
        "kernels": kernels_path,
        "wrapped_layers": len(layers),
    }
    serving = [asdict(r) for r in rows]
    describe = (
        f"{spec} ({config['dtype']}, {device.type}), batch {batch}, {prompt_len}-token prompts, {new_tokens} "
        f"greedy tokens each (ignore_eos), {ADAPTERS} adapters of rank {RANK} on {', '.join(TARGETS)}"
    )
    console.print(table(f"LoRA serving: Engine output tokens/s, {describe}", serving))
    base_step_ms = rows[0].step_ms
    kernels = [asdict(r) for r in bench_kernels(layers, backend, batch, base_step_ms)]
    console.print(
        table(
            f"LoRA kernels per decode step (lora_apply; lora_shrink, lora_expand beside it; {batch} rows "
            f"over {ADAPTERS} slots, pool rank {RANK}; {kernels_path}) vs the base engine step, {spec} "
            f"({config['dtype']})",
            kernels,
        )
    )
    del layers
    gc.collect()
    restore(model)
    return {"lora_config": config, "lora_throughput": serving, "lora_kernels": kernels}
