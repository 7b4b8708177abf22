"""``hfaccel bench engine``: serving many requests — throughput and latency against what a user would use.

N requests with seeded random prompt and output lengths (random token ids: speed does not depend on them),
served by: sequential ``generate`` (transformers sdpa, on a subset, throughput extrapolated per token); padded
static batches of ``generate``; transformers' continuous batching ``generate_batch`` (sized explicitly: same
KV pool and token budget as the engine; it takes one output length for all requests, the mean, and its
throughput counts what it generated); and ``hfaccel.Engine`` (on CUDA also with synchronous scheduling, to
show what overlapping the host's work with the device's gives). Every path is warmed up on the workload it is
then timed on (its first run compiles, captures and fills caches; the second is timed), and the engine's two
modes alternate A B B A so that neither is favoured by going first or last. Reported: output tokens/s, its ratio
to ``generate_batch``, and TTFT / inter-token latency percentiles where the path exposes them. A second table
times the engine's decode step at batch 64 (the CUDA-graph replay the engine runs, or its eager forward
without graphs) against reading the weights it touches once at the measured read bandwidth (a read-only kernel).

``--tensor-parallel-size N`` instead serves the workload with the engine over N ranks and reports the all-reduce
share of its decode step (``hfaccel.tools.bench.engine_tp``).

``--host`` instead splits the host's time per engine step (``Engine.host_times``) at batch 1, 64 and 256:
scheduling, metadata, launch, waiting for the device, detokenizing — what the device waits on when the host is
slower than a step.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from hfaccel import compat
from hfaccel.engine import Engine
from hfaccel.hf import accelerate, restore
from hfaccel.sampling import SamplingParams
from hfaccel.tools.bench.loadgen import percentiles_ms
from hfaccel.tools.bench.timing import interleaved_runs, read_bandwidth, read_ms, sync, table, weight_read_bytes
from hfaccel.tools.assets import cached_smollm2
from hfaccel.tools.models import build_model


DECODE_BATCH = 64
DECODE_CONTEXTS = (128, 1024)
HOST_BATCHES = (1, 64, 256)
HOST_PROMPT, HOST_OUTPUT = 16, 64  # tokens per request of the host-time workload


@dataclass
class ServingRow:
    path: str
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    vs_generate_batch: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None


@dataclass
class DecodeStepRow:
    path: str  # "cuda graph" or "eager"
    batch: int
    context: int
    step_ms: float
    weight_read_ms: float  # weight bytes a step reads / measured read bandwidth
    ratio: float  # step / weight read (goal on a GPU: <= 1.5)


@dataclass
class HostStepRow:
    batch: int
    steps: int
    step_ms: float  # wall time per step
    scheduling_ms: float
    metadata_ms: float
    launch_ms: float  # on a CPU this holds the forward's computation
    waiting_ms: float
    detokenizing_ms: float
    other_ms: float  # the rest of the step (collecting bookkeeping, outputs)
    generate_step_ms: float  # transformers' generate() of the same batch (its padded batch), per step
    vs_generate: float  # step_ms / generate_step_ms


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def bench_engine(
    model,
    work: Workload,
    device: torch.device,
    *,
    max_num_seqs: int,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    static_batch: int = 32,
    sequential_subset: int = 8,
    kv_cache_dtype: str | None = None,
):
    """Rows for each serving path, and the decode-step table. Every path is timed on its second run of the
    workload (the first compiles, captures and warms caches); the engine's variants alternate, A B B A, and each
    reports the median of its two timed runs. ``kv_cache_dtype`` ("fp8"): one more engine, its pool in that dtype
    in the same memory as the others' (more blocks)."""
    need = sum(-(-(len(p) + n) // block_size) for p, n in zip(work.prompts, work.output_lens))
    num_blocks = max(need, DECODE_BATCH * -(-(max(DECODE_CONTEXTS) + 8) // block_size))  # + the decode table
    rows = [_generate_batch(model, work, num_blocks, block_size, max_num_batched_tokens, device)]
    rows.append(_sequential(model, work, sequential_subset, device))
    rows.append(_static_batches(model, work, static_batch, device))
    accelerate(model, paged=False)
    settings = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_blocks": num_blocks,
        "block_size": block_size,
    }
    engines = {"hfaccel Engine": Engine(model, **settings)}
    if engines["hfaccel Engine"].async_scheduling:
        engines["hfaccel Engine, synchronous scheduling"] = Engine(model, async_scheduling=False, **settings)
    memory = engines["hfaccel Engine"].stats()["kv_cache_bytes"]  # (none where no layer keeps K/V: Mamba)
    if kv_cache_dtype is not None and memory:
        quantized = {**settings, "num_blocks": None, "kv_cache_memory": memory}
        engine = Engine(model, kv_cache_dtype=kv_cache_dtype, **quantized)
        engines[f"hfaccel Engine, {kv_cache_dtype} KV cache ({engine.stats()['blocks_total']} blocks)"] = engine
    runs = {name: partial(_engine_run, engine, work, device, name) for name, engine in engines.items()}
    rows += list(interleaved_runs(runs, speed=lambda row: row.tokens_per_s).values())
    decode = [_decode_step(engines["hfaccel Engine"], DECODE_BATCH, context, device) for context in DECODE_CONTEXTS]
    del engines
    gc.collect()
    restore(model)
    baseline = rows[0].tokens_per_s
    for row in rows:
        row.vs_generate_batch = row.tokens_per_s / baseline if baseline else None
    return rows, decode


def _generate_batch(
    model, work: Workload, num_blocks: int, block_size: int, max_tokens: int, device: torch.device
) -> ServingRow:
    from transformers import GenerationConfig

    mean_len = round(statistics.mean(work.output_lens))
    config = GenerationConfig(max_new_tokens=mean_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_config, settings = compat.continuous_batching_config(
        num_blocks, block_size, max_tokens, fastest=device.type == "cuda"
    )
    for _ in range(2):  # the first run warms up; the second is timed
        start = time.perf_counter()
        outputs = model.generate_batch(
            inputs=work.prompts, generation_config=config, continuous_batching_config=cb_config, record_timestamps=True
        )
        sync(device)
        seconds = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    ttft = [o.timestamps[0] - o.created_time for o in outputs.values() if o.timestamps]
    itl = [b - a for o in outputs.values() if o.timestamps for a, b in zip(o.timestamps, o.timestamps[1:])]
    return _row(f"transformers generate_batch ({settings})", len(work.prompts), produced, seconds, ttft, itl)


def _sequential(model, work: Workload, subset: int, device: torch.device) -> ServingRow:
    tokens, seconds = 0, 0.0
    model.generate(
        torch.tensor([work.prompts[0]], device=device), max_new_tokens=4, do_sample=False, pad_token_id=0
    )  # warm-up
    for prompt, length in list(zip(work.prompts, work.output_lens))[:subset]:
        ids = torch.tensor([prompt], device=device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=length, min_new_tokens=length, do_sample=False, pad_token_id=0)
        sync(device)
        seconds += time.perf_counter() - start
        tokens += length
    return _row(f"sequential generate (first {subset})", subset, tokens, seconds, [], [])


def _static_batches(model, work: Workload, size: int, device: torch.device) -> ServingRow:
    _static_batch(model, work.prompts[:size], work.output_lens[:size], device)  # warm-up
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(work.prompts), size):
        lengths = work.output_lens[first : first + size]
        _static_batch(model, work.prompts[first : first + size], lengths, device)
        tokens += sum(lengths)  # what the requests asked for; the rest of each row is padding work
    sync(device)
    return _row(f"padded static batches of {size}", len(work.prompts), tokens, time.perf_counter() - start, [], [])


def _static_batch(model, prompts: list[list[int]], lengths: list[int], device: torch.device) -> None:
    """One left-padded generate() of ``prompts``, every row as long as the longest output."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max(lengths),
        min_new_tokens=max(lengths),
        do_sample=False,
        pad_token_id=0,
    )


def _engine_run(engine: Engine, work: Workload, device: torch.device, name: str) -> ServingRow:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    itl = [gap for o in outputs for gap in o.metrics.inter_token_latencies]
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _row(name, len(work.prompts), produced, seconds, ttft, itl)


def _decode_step(engine: Engine, batch: int, context: int, device: torch.device) -> DecodeStepRow:
    """Milliseconds of one decode step of ``batch`` sequences at ``context`` tokens each, as the engine runs
    it (CUDA-graph replay, inputs filled from the host, when the engine has graphs)."""
    runner, manager, graphs = engine.runner, engine.scheduler.manager, engine.runner.graphs
    path = "cuda graph" if graphs is not None and graphs.capture else "eager"
    ids = list(range(10**9, 10**9 + batch))
    blocks = manager.blocks_needed(context + 4) * batch
    if blocks > manager.num_free_blocks:
        return DecodeStepRow(path, batch, context, float("nan"), float("nan"), float("nan"))
    tokens = torch.randint(3, engine.vocab_size, (context,), device=device)
    for seq_id in ids:  # one prompt per forward: within a TP engine's step buffer (max_num_batched_tokens)
        runner.forward([seq_id], tokens, [context])
    step = torch.randint(3, engine.vocab_size, (batch,), device=device)
    runner.forward(ids, step, [1] * batch)  # the slot of position ``context``; warm-up
    run = lambda: runner.forward(ids, step, [1] * batch, starts=[context] * batch)  # noqa: E731
    run()  # graphs: capture
    sync(device)
    path = "cuda graph" if graphs is not None and graphs.capture and graphs.serves([1] * batch, "last") else "eager"
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        run()
    sync(device)
    step_ms = (time.perf_counter() - start) / reps * 1e3
    for seq_id in ids:
        runner.free(seq_id)
    weight_ms = read_ms(weight_read_bytes(engine.model, batch), read_bandwidth(device))
    return DecodeStepRow(path, batch, context, step_ms, weight_ms, step_ms / weight_ms)


def _row(path: str, requests: int, tokens: int, seconds: float, ttft: list[float], itl: list[float]) -> ServingRow:
    return ServingRow(
        path, requests, tokens, seconds, tokens / seconds, None, *percentiles_ms(ttft), *percentiles_ms(itl)
    )


def bench_host(model, tokenizer, batches, device: torch.device) -> list[HostStepRow]:
    """The engine's host time per step, split by part, serving ``batch`` requests at once (HOST_PROMPT-token prompts,
    HOST_OUTPUT greedy tokens each) — timed on the second run of the workload, the first warming up — beside the
    step of transformers' generate() on the same batch (the baseline a step should not lose to)."""
    rows = []
    for batch in batches:
        work = make_workload(batch, (HOST_PROMPT, HOST_PROMPT), (HOST_OUTPUT, HOST_OUTPUT), model.config.vocab_size)
        restore(model)
        _static_batch(model, work.prompts, work.output_lens, device)  # warm-up
        start = time.perf_counter()
        _static_batch(model, work.prompts, work.output_lens, device)
        sync(device)
        generate_ms = (time.perf_counter() - start) * 1e3 / HOST_OUTPUT
        accelerate(model, paged=False)
        blocks = batch * -(-(HOST_PROMPT + HOST_OUTPUT) // 16) + 1
        engine = Engine(
            model,
            tokenizer,
            max_num_seqs=batch,
            num_blocks=blocks,
            max_num_batched_tokens=max(512, batch * HOST_PROMPT),
            enable_prefix_caching=False,
        )
        params = SamplingParams(max_tokens=HOST_OUTPUT, temperature=0, ignore_eos=True)
        engine.generate(work.prompts, params)  # warm-up
        engine.host_times.reset()
        start = time.perf_counter()
        outputs = engine.generate(work.prompts, params)
        sync(device)
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} of {batch} requests failed in the host-time run: {failed[0]}")
        times = engine.host_times
        step_ms = (time.perf_counter() - start) * 1e3 / max(times.steps, 1)
        parts = times.per_step_ms()
        rows.append(
            HostStepRow(
                batch,
                times.steps,
                step_ms,
                *parts.values(),
                step_ms - sum(parts.values()),
                generate_ms,
                step_ms / generate_ms,
            )
        )
        del engine
        gc.collect()
    return rows


def _host_tokenizer(model):
    """SmolLM2's tokenizer when the cache holds it and it covers the model's vocabulary (its detokenization is
    then part of the figures), else None (token ids only)."""
    from transformers import AutoTokenizer

    path = cached_smollm2()
    if path is None:
        return None
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer if len(tokenizer) >= model.config.vocab_size else None


def run(options, console) -> dict:
    spec = options.model or ("llama-3.2-1b" if options.cuda else "tiny-llama")
    net = build_model(spec, options.device, options.dtypes[0])
    if options.host:
        tokenizer = _host_tokenizer(net)
        rows = [asdict(r) for r in bench_host(net, tokenizer, options.batches or HOST_BATCHES, options.device)]
        detok = "with SmolLM2's tokenizer" if tokenizer is not None else "token ids only, no detokenization"
        console.print(
            table(
                f"engine host time per step (ms), {spec}, {HOST_PROMPT}-token prompts, {HOST_OUTPUT} "
                f"greedy tokens, {detok}",
                rows,
            )
        )
        restore(net)
        return {"engine_host": rows}
    count = options.num_requests or (256 if options.cuda else 32)
    work = make_workload(
        count, (16, 512) if options.cuda else (8, 64), (16, 256) if options.cuda else (4, 32), net.config.vocab_size
    )
    if options.tensor_parallel_size > 1:
        from hfaccel.tools.bench.engine_tp import run_tp

        del net  # every rank loads its shard from a saved copy
        return run_tp(
            options,
            console,
            spec,
            work,
            max_num_seqs=256 if options.cuda else 16,
            max_num_batched_tokens=4096 if options.cuda else 512,
        )
    # generate_batch bounds its running requests by KV blocks and tokens only: the engine gets the same freedom
    # (256 sequences, its largest decode graph), so that neither path's TTFT is a queue the other does not have
    rows, decode = bench_engine(
        net,
        work,
        options.device,
        max_num_seqs=256 if options.cuda else 16,
        max_num_batched_tokens=4096 if options.cuda else 512,
        kv_cache_dtype=options.kv_cache_dtype,
    )
    serving, steps = [asdict(r) for r in rows], [asdict(r) for r in decode]
    console.print(table(f"serving {count} requests, {spec}: output tokens/s and latency", serving))
    console.print(table(f"engine decode step vs reading the weights once ({spec})", steps))
    return {"engine": serving, "engine_decode_step": steps}
