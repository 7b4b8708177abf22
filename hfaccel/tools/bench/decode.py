"""``hfaccel bench decode``: ``generate`` decode speed of each path a user could pick, on a model built from a named
real config with random weights (speed does not depend on the weights' values) or a local model folder:

- transformers sdpa (its eager loop and DynamicCache),
- transformers static cache + torch.compile (its own fast path; CUDA only),
- ``hfaccel.accelerate(model)`` (the default: hfaccel's decode loop, compiled and captured steps on CUDA),
- ``hfaccel.accelerate(model, compile=False)``,
- off CUDA, ``hfaccel.accelerate(model, compile=True)`` (there: transformers' static cache and compiled forward).

A second table gives the sampler's share of hfaccel's decode step (``sampling.sample`` on the model's vocabulary at
each batch size: greedy rows, and seeded rows at temperature 1 with top-p 0.9, keyed noise over the vocabulary;
and ``sampling.draw_step``, the draw the engine's decode steps end with, on the seeded rows — run on its own here,
uncompiled). With ``--profile`` a third splits hfaccel's decode step by kernel: the device time per step of each
kernel (the ones a CUDA graph replays, on a GPU; the ops, on the CPU), from ``torch.profiler`` over the same two
calls the step's time comes from.

The ratio column divides by the fastest of transformers' paths that ran the model (named in ``baseline``; a path
that cannot run it, say static cache + compile on a model it does not compile, is listed in ``decode_failures``).
Each path is warmed up on the exact call it is then timed on (compiles and captures happen there). A decode
step's time is ``(t(N new tokens) - t(1 new token)) / (N - 1)``: the prompt's prefill cancels out. The roofline of
a decode step is one read of the weights it touches (:func:`timing.weight_read_bytes`: of a mixture of experts, the
experts its batch reaches) at the bandwidth a read-only kernel reaches (:func:`timing.read_bandwidth`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from hfaccel.hf import accelerate, restore
from hfaccel.device import to_device
from hfaccel.sampling import SampleRow, SamplingParams, draw_columns, draw_step, sample
from hfaccel.tools.bench.timing import read_bandwidth, read_ms, sync, table, time_ms, weight_read_bytes
from hfaccel.runner.step_function import failure_reason
from hfaccel.tools.models import build_model

STATIC_COMPILE = "transformers static+compile"


@dataclass
class DecodeRow:
    model: str
    dtype: str
    path: str
    batch: int
    prompt_len: int
    new_tokens: int
    tokens_per_s: float  # decode tokens per second: batch / step
    ms_per_step: float
    vs_baseline: float | None  # tokens_per_s / that of the fastest transformers path that ran (``baseline``)
    baseline: str | None  # None: no transformers path ran the model (``decode_failures`` says why)
    pct_roofline: float  # one weight read at the read bandwidth / the step
    vocab_size: int


@dataclass
class SamplerRow:
    model: str
    batch: int
    rows: str  # "greedy", "seeded (temperature 1, top-p 0.9)" or the same drawn by draw_step
    sample_ms: float  # sampling.sample (or draw_step) on [batch, vocab] logits, queued and done
    share_of_step: float  # sample_ms / hfaccel's decode step at this batch


@dataclass
class KernelRow:
    model: str
    batch: int
    kernel: str  # a device kernel's name (an op's on the CPU), its first 100 characters
    calls_per_step: float
    us_per_step: float  # its device time (self time on the CPU) in one decode step
    share_of_step: float  # of the device time of every kernel in the step


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
PROFILE_TOP = 15  # kernels listed per batch


def sampler_rows(decode: list[DecodeRow], device: torch.device) -> list[SamplerRow]:
    """The sampler's time per step for greedy and for seeded rows, and its share of hfaccel's decode step."""
    rows = []
    for step in (row for row in decode if row.path == "hfaccel"):
        batch, step_ms = step.batch, step.ms_per_step
        logits = torch.randn(batch, step.vocab_size, device=device)
        for label, params in (
            ("greedy", SamplingParams(temperature=0)),
            ("seeded (temperature 1, top-p 0.9)", SAMPLED),
        ):
            sample_rows = [SampleRow(params, params.seed, [1], [], stream=i) for i in range(batch)]
            ms = time_ms(lambda: sample(logits, sample_rows).tokens, device)
            rows.append(SamplerRow(step.model, batch, label, ms, ms / step_ms))
        columns = to_device(draw_columns(sample_rows), torch.long, device)  # [8, batch]: the seeded rows
        ms = time_ms(lambda: draw_step(logits, columns), device)
        rows.append(SamplerRow(step.model, batch, "seeded, in-step draw (draw_step)", ms, ms / step_ms))
    return rows


def decode_paths(device: torch.device, attention: str = "sdpa") -> list[str]:
    """The paths measured; ``attention``: the model's own (sdpa, or eager where transformers runs it so)."""
    paths = [f"transformers {attention}"]
    if device.type == "cuda":
        paths.append(STATIC_COMPILE)
    # off CUDA the default does not compile; compile=True there runs transformers' static cache and compiled forward
    return paths + ["hfaccel", "hfaccel compile=False"] + ([] if device.type == "cuda" else ["hfaccel compile=True"])


def _prepare(model, path: str) -> dict:
    """Put the model on ``path``; the generate() arguments that path needs."""
    from transformers import CompileConfig

    restore(model)
    if path == "hfaccel":
        accelerate(model)
    elif path == "hfaccel compile=False":
        accelerate(model, compile=False)
    elif path == "hfaccel compile=True":
        accelerate(model, compile=True)
    elif path == STATIC_COMPILE:
        return dict(cache_implementation="static", compile_config=CompileConfig())
    return {}


def _seconds(model, input_ids: torch.Tensor, new_tokens: int, kwargs: dict, reps: int) -> float:
    """Median wall seconds of a greedy generate() of exactly ``new_tokens`` tokens (after one untimed call)."""
    args = _greedy_args(new_tokens, kwargs)
    model.generate(input_ids, **args)  # warm-up on this exact call (compiles, captures)
    samples = []
    for _ in range(reps):
        sync(input_ids.device)
        start = time.perf_counter()
        model.generate(input_ids, **args)
        sync(input_ids.device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _greedy_args(new_tokens: int, kwargs: dict) -> dict:
    """The ``generate`` arguments of a timed or profiled call: greedy, exactly ``new_tokens`` tokens."""
    return dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def step_ms(model, input_ids: torch.Tensor, new_tokens: int, kwargs: dict, reps: int = 3) -> float:
    """Milliseconds of one decode step of ``generate`` (the prefill cancels out)."""
    full = _seconds(model, input_ids, new_tokens, kwargs, reps)
    prefill = _seconds(model, input_ids, 1, kwargs, reps)
    return max(full - prefill, 1e-9) / (new_tokens - 1) * 1e3


def kernel_rows(spec: str, model, input_ids: torch.Tensor, new_tokens: int, kwargs: dict) -> list[KernelRow]:
    """The prepared path's decode step by kernel, the top :data:`PROFILE_TOP`: per kernel, the calls a profiled
    ``generate`` of ``new_tokens`` tokens makes beyond those of one of 1 token — its last ones, since generate
    prefills first — their time summed and divided by ``new_tokens - 1``. Summing the decode calls themselves, rather
    than subtracting the two runs' totals, gives no negative or noise-sized time on a loaded machine. The calls are
    warm: :func:`step_ms` made them just before."""
    full = _kernel_calls(model, input_ids, new_tokens, kwargs)
    prefill = _kernel_calls(model, input_ids, 1, kwargs)
    steps = new_tokens - 1
    per_step = {}  # kernel -> (µs, calls) per decode step
    for name, times in full.items():
        decode = times[len(prefill.get(name, ())) :]
        if decode:
            per_step[name] = (sum(decode) / steps, len(decode) / steps)
    total = sum(us for us, _ in per_step.values()) or 1.0
    ranked = sorted(per_step.items(), key=lambda item: -item[1][0])[:PROFILE_TOP]
    return [KernelRow(spec, input_ids.shape[0], name[:100], calls, us, us / total) for name, (us, calls) in ranked]


def _kernel_calls(model, input_ids: torch.Tensor, new_tokens: int, kwargs: dict) -> dict[str, list[float]]:
    """Each kernel's calls in one greedy ``generate``, in order: their self device time in µs (each op's self CPU
    time on the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = input_ids.device.type == "cuda"
    args = _greedy_args(new_tokens, kwargs)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiled:
        model.generate(input_ids, **args)
        sync(input_ids.device)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    calls: dict[str, list[float]] = {}
    for event in sorted(profiled.events(), key=lambda event: event.time_range.start):
        if event.device_type == kind:
            calls.setdefault(event.key, []).append(event.self_device_time_total if cuda else event.self_cpu_time_total)
    return calls


def _set_up_tracer(device: torch.device) -> None:
    """Start and stop the profiler's CUDA tracer once, before the first CUDA graph is made: a tracer set up after a
    graph was made may not report that graph's kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        sync(device)


def bench_decode(
    spec: str,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    profile: bool = False,
    layers: int | None = None,
    failures: dict | None = None,
) -> tuple[list[DecodeRow], list[KernelRow]]:
    """Decode speed of each path at each batch size (greedy, fixed length, random prompts); with ``profile``
    hfaccel's decode step by kernel at each batch size. A path that raises is left out, its reason put in
    ``failures`` (path and batch -> reason)."""
    if new_tokens < 2:
        raise ValueError(f"bench decode times decode steps: new_tokens must be >= 2; got {new_tokens}")
    if profile and device.type == "cuda":
        _set_up_tracer(device)
    model = build_model(spec, device, dtype, layers)
    bandwidth = read_bandwidth(device)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows, kernels = [], []
    for batch in batches:
        input_ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
        measured = {}
        for path in decode_paths(device, model.config._attn_implementation):
            try:
                kwargs = _prepare(model, path)
                measured[path] = step_ms(model, input_ids, new_tokens, kwargs)
            except Exception as error:  # a path that cannot run this model: the others are still measured
                if failures is None:
                    raise
                failures[f"{spec} {path} batch {batch}"] = failure_reason(error)
                continue
            if profile and path == "hfaccel":
                kernels += kernel_rows(spec, model, input_ids, new_tokens, kwargs)
        restore(model)
        weight_ms = read_ms(weight_read_bytes(model, batch), bandwidth)
        theirs = {path: ms for path, ms in measured.items() if path.startswith("transformers")}
        baseline = min(theirs, key=theirs.get) if theirs else None
        rows += [
            DecodeRow(
                spec,
                str(dtype).removeprefix("torch."),
                path,
                batch,
                prompt_len,
                new_tokens,
                batch / ms * 1e3,
                ms,
                theirs[baseline] / ms if baseline else None,
                baseline,
                weight_ms / ms * 100,
                vocab,
            )
            for path, ms in measured.items()
        ]
    return rows, kernels


def plan(options) -> list[tuple[str, torch.dtype]]:
    """(model, dtype) pairs to measure: the named model in the first dtype, or the issue's two models on CUDA."""
    if options.model:
        return [(options.model, options.dtypes[0])]
    if options.cuda:
        return [("llama-3.2-1b", torch.float16), ("llama-3.1-8b", torch.bfloat16)]
    return [("tiny-llama", options.dtypes[0])]


def run(options, console) -> dict:
    rows, sampler, kernels, failures = [], [], [], {}
    for spec, dtype in plan(options):
        measured, profiled = bench_decode(
            spec,
            options.batches or ([1, 16, 64] if options.cuda else [1, 4]),
            options.prompt_len or (128 if options.cuda else 32),
            options.new_tokens or (128 if options.cuda else 16),
            options.device,
            dtype,
            profile=options.profile,
            layers=options.layers,
            failures=failures,
        )
        sampler += sampler_rows(measured, options.device)
        rows += measured
        kernels += profiled
    rows, sampler, kernels = ([asdict(r) for r in part] for part in (rows, sampler, kernels))
    console.print(
        table(
            "decode: generate() decode steps (vs_baseline: the fastest transformers path that ran, "
            "named in baseline; pct_roofline: one weight read at the read bandwidth / the step)",
            rows,
        )
    )
    for where, reason in failures.items():
        console.print(f"[yellow]could not run {where}: {reason}")
    console.print(table("the sampler's share of hfaccel's decode step", sampler))
    if not options.profile:
        return {"decode": rows, "decode_sampler": sampler, "decode_failures": failures}
    console.print(
        table(
            f"hfaccel's decode step by kernel (torch.profiler; the top {PROFILE_TOP} by time per step, "
            "share of the step's kernel time)",
            kernels,
        )
    )
    return {"decode": rows, "decode_sampler": sampler, "decode_kernels": kernels, "decode_failures": failures}


@dataclass
class QuantizedDecodeRow:
    model: str
    weights: str
    batch: int
    new_tokens: int
    tokens_per_s: float  # decode tokens per second: batch / step
    ms_per_step: float
    speedup: float  # vs the 16-bit weights at the same batch
    weight_gb: float  # bytes one decode step reads from the weights
    pct_roofline: float  # one read of those bytes at the read bandwidth / the step


def dense_then_quantized(
    spec: str, batches, prompt_len: int, new_tokens: int, device: torch.device, dtype: torch.dtype, quantize_model
) -> list[QuantizedDecodeRow]:
    """Accelerated generate() decode steps with the model's 16-bit weights, then with the same model quantized in
    place by ``quantize_model(model)`` (which returns the weights' label), so the dense run always comes first."""
    model = build_model(spec, device, dtype)
    bandwidth = read_bandwidth(device)
    inputs = {b: torch.randint(3, model.config.vocab_size, (b, prompt_len), device=device) for b in batches}
    rows: list[QuantizedDecodeRow] = []
    for quantized in (False, True):
        weights = quantize_model(model) if quantized else str(dtype).removeprefix("torch.")
        accelerate(model)
        for batch in batches:
            step_bytes = weight_read_bytes(model, batch)
            ms = step_ms(model, inputs[batch], new_tokens, {})
            dense = next((r.ms_per_step for r in rows if r.batch == batch), None)
            rows.append(
                QuantizedDecodeRow(
                    spec,
                    weights,
                    batch,
                    new_tokens,
                    batch / ms * 1e3,
                    ms,
                    dense / ms if dense else 1.0,
                    step_bytes / 1e9,
                    100 * read_ms(step_bytes, bandwidth) / ms,
                )
            )
        restore(model)
    return rows
