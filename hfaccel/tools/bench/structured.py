"""``hfaccel bench structured``: what structured outputs (``SamplingParams.structured_outputs``) cost.

1. Mask time per token on the host: real constrained generations of the Engine (JSON schemas, JSON mode, regexes,
   a choice; a few requests each, sampled at temperature 0.7) are replayed token by token through a fresh
   matcher of their grammar, timing what the engine's host does for each token of a constrained row —
   ``fill_next_token_bitmask`` (the row of the mask the next draw sees) and ``accept_token`` — as p50 / p99 / mean
   per spec, with the time the spec took to compile (once per tokenizer; the engine caches it).
2. Engine throughput (output tokens/s) serving the same prompts with 0%, 50% and 100% of the requests structured,
   in one batch, every request greedy with ``ignore_eos`` and the same ``max_tokens`` (the structured ones ask for
   a JSON array of at least :data:`MIN_ITEMS` records, a language no output ends within ``max_tokens``, so every
   run produces the same number of tokens), with its ratio to the 0% run and the host time ``apply_masks`` takes
   per step (filling the rows' masks, the one host-to-device copy and the kernel's launch; on a GPU the kernel
   itself runs on the device, after the step's forward). Each fraction runs once to warm up, then twice in the
   order 0 50 100 100 50 0; the median of its two timed runs is reported. On CUDA a constrained request turns
   the asynchronous scheduler's step overlap off (its mask needs the last token on the host): the 50% and 100%
   rows include that. Goal on a GPU (issue 31): 100% structured ≥ 0.9× the unconstrained throughput.

Default model: the real SmolLM2-135M-Instruct (``hfaccel.tools.assets``; its tokenizer makes the grammars).
``--model`` a named config: random weights of its shapes over SmolLM2's tokenizer (its vocabulary at least);
a model folder: that model and its tokenizer.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from hfaccel.engine import Engine
from hfaccel.hf import accelerate, restore
from hfaccel.sampling import SamplingParams, StructuredOutputs
from hfaccel.sampling.structured import Grammars
from hfaccel.tools.bench.loadgen import percentiles_ms
from hfaccel.tools.bench.timing import interleaved_runs, sync, table
from hfaccel.tools.models import NAMED_CONFIGS

_NAME = {"type": "string", "maxLength": 16}
_AGE = {"type": "integer", "minimum": 0, "maximum": 120}
RECORD = {
    "type": "object",
    "properties": {"name": _NAME, "age": _AGE, "city": {"enum": ["Paris", "Lima", "Oslo", "Cairo", "Kyoto"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

# (name, spec, prompt): the mask-time cases
MASK_CASES: list[tuple[str, dict, str]] = [
    (
        "json: flat object",
        {
            "json": {
                "type": "object",
                "properties": {"name": _NAME, "age": _AGE, "email": {"type": "string", "format": "email"}},
                "required": ["name", "age", "email"],
                "additionalProperties": False,
            }
        },
        "Describe a person as JSON with their name, age and email:",
    ),
    (
        "json: nested + arrays",
        {
            "json": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "authors": {"type": "array", "items": RECORD, "minItems": 1, "maxItems": 3},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
                    "meta": {
                        "type": "object",
                        "properties": {
                            "pages": {"type": "integer", "minimum": 1},
                            "published": {"type": "string", "format": "date"},
                        },
                        "required": ["pages", "published"],
                        "additionalProperties": False,
                    },
                },
                "required": ["title", "authors", "meta"],
                "additionalProperties": False,
            }
        },
        "Give the details of a book as JSON:",
    ),
    (
        "json: enums + pattern",
        {
            "json": {
                "type": "object",
                "properties": {
                    "status": {"enum": ["open", "closed", "pending"]},
                    "priority": {"type": "integer", "enum": [1, 2, 3]},
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "score": {"type": "number"},
                    "done": {"type": "boolean"},
                },
                "required": ["status", "priority", "code", "score", "done"],
                "additionalProperties": False,
            }
        },
        "A support ticket as JSON:",
    ),
    (
        "json: array of records",
        {"json": {"type": "array", "items": RECORD, "minItems": 2, "maxItems": 6}},
        "List some people as a JSON array:",
    ),
    ("json_object", {"json_object": True}, "Any JSON object describing the weather:"),
    ("regex: phone number", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}, "Call us at"),
    ("regex: sentence", {"regex": r"[A-Z][a-z]+( [a-z]+){3,15}\."}, "Write one sentence about the sea:"),
    ("choice", {"choice": ["positive", "negative", "neutral"]}, "The sentiment of 'I loved it' is"),
]
MASK_REQUESTS = 4  # generations per mask case
MIN_ITEMS = 1000  # the throughput run's JSON array: at least this many records (no output ends within max_tokens)
THROUGHPUT_SPEC = {"json": {"type": "array", "items": RECORD, "minItems": MIN_ITEMS}}
FRACTIONS = (0, 50, 100)  # percent of the requests structured


@dataclass
class MaskRow:
    spec: str
    requests: int
    stopped: int  # outputs the grammar ended (the rest hit max_tokens)
    tokens: int
    p50_us: float | None  # fill_next_token_bitmask + accept_token, per token
    p99_us: float | None
    mean_us: float | None
    compile_ms: float | None  # once per tokenizer and spec


@dataclass
class ThroughputRow:
    structured_pct: int
    requests: int
    structured: int
    max_tokens: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    vs_unconstrained: float | None
    steps: int
    mask_ms_per_step: float  # host time in apply_masks per engine step


def load(spec: str | None, device: torch.device, dtype: torch.dtype, tokenizer_path: str | None = None):
    """(model, tokenizer): the real SmolLM2-135M-Instruct (default), a named config's random-weight model over
    ``tokenizer_path``'s tokenizer (default: SmolLM2's), or a model folder and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hfaccel.tools.assets import smollm2_path

    if spec is None or spec not in NAMED_CONFIGS:
        path = Path(spec) if spec else smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        return model.eval(), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or smollm2_path())
    fields = dict(NAMED_CONFIGS[spec])
    fields["vocab_size"] = max(fields["vocab_size"], len(tokenizer))
    fields.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), tokenizer


def bench_masks(engine: Engine, tokenizer, max_tokens: int, requests: int = MASK_REQUESTS) -> list[MaskRow]:
    """Generate ``requests`` outputs per mask case with the engine, then replay each output's tokens through a
    fresh matcher, timing fill + accept per token."""
    import xgrammar

    prompts, params = [], []
    for case, (_, spec, prompt) in enumerate(MASK_CASES):
        for i in range(requests):
            prompts.append(prompt)
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=1000 * case + i, structured_outputs=spec)
            )
    outputs = engine.generate(prompts, params)
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} constrained generations failed: {failed[0]}")
    grammars = Grammars(tokenizer, engine.vocab_size)  # its own compiler: the compile below is a first one
    bitmask = xgrammar.allocate_token_bitmask(1, engine.vocab_size)
    rows, everything = [], []
    for case, (name, spec, _) in enumerate(MASK_CASES):
        structured = StructuredOutputs.from_dict(spec)
        start = time.perf_counter()
        grammars.compile(structured)
        compile_ms = (time.perf_counter() - start) * 1e3
        times, stopped = [], 0
        for output in outputs[case * requests : (case + 1) * requests]:
            completion = output.outputs[0]
            stopped += completion.finish_reason == "stop"
            constraint = grammars.constraint(structured)
            for token in completion.token_ids:
                start = time.perf_counter()
                constraint.fill(bitmask, 0)
                accepted = constraint.accept(token)
                times.append(time.perf_counter() - start)
                if not accepted:
                    raise RuntimeError(f"{name}: the replayed matcher refused token {token} of its own output")
        everything += times
        rows.append(_mask_row(name, requests, stopped, times, compile_ms))
    rows.append(_mask_row("all", len(outputs), sum(r.stopped for r in rows), everything, None))
    return rows


def _mask_row(name: str, requests: int, stopped: int, times: list[float], compile_ms: float | None) -> MaskRow:
    p50, p99 = percentiles_ms(times)
    us = lambda ms: None if ms is None else ms * 1e3  # noqa: E731
    mean = sum(times) / len(times) * 1e6 if times else None
    return MaskRow(name, requests, stopped, len(times), us(p50), us(p99), mean, compile_ms)


def throughput_prompts(count: int) -> list[str]:
    return [f"Request {i}: list the members of club number {i} as a JSON array of records." for i in range(count)]


def bench_throughput(
    engine: Engine, prompts: list[str], max_tokens: int, fractions: tuple[int, ...] = FRACTIONS
) -> list[ThroughputRow]:
    """Output tokens/s of ``engine`` serving ``prompts`` with each percentage of them structured (every request
    greedy, ``ignore_eos``, ``max_tokens`` tokens); warm-up runs first, then A B C C B A, medians of two."""
    runs = {pct: partial(_serve, engine, prompts, max_tokens, pct) for pct in fractions}
    rows = list(interleaved_runs(runs, speed=lambda row: row.tokens_per_s).values())
    base = next((row.tokens_per_s for row in rows if row.structured_pct == 0), None)
    for row in rows:
        row.vs_unconstrained = row.tokens_per_s / base if base else None
    return rows


def _serve(engine: Engine, prompts: list[str], max_tokens: int, pct: int) -> ThroughputRow:
    count = len(prompts)
    structured = round(count * pct / 100)
    order = list(range(0, count, 2)) + list(range(1, count, 2))  # 50%: every other request
    chosen = set(order[:structured])
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            structured_outputs=THROUGHPUT_SPEC if i in chosen else None,
        )
        for i in range(count)
    ]
    steps, mask_seconds = engine.host_times.steps, engine.host_times.masks
    device = engine.runner.device
    sync(device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    mask_seconds = engine.host_times.masks - mask_seconds
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {count} requests failed in the {pct}% structured run: {failed[0]}")
    steps = engine.host_times.steps - steps
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputRow(
        pct,
        count,
        len(chosen),
        max_tokens,
        produced,
        seconds,
        produced / seconds,
        None,
        steps,
        mask_seconds * 1e3 / max(steps, 1),
    )


def run(options, console) -> dict:
    device, dtype = options.device, options.dtypes[0]
    name = options.model or "SmolLM2-135M-Instruct"
    model, tokenizer = load(options.model, device, dtype, options.tokenizer)
    count = options.num_requests or (256 if options.cuda else 16)
    throughput_tokens = options.new_tokens or (256 if options.cuda else 32)
    mask_tokens = options.new_tokens or (256 if options.cuda else 96)
    prompts = throughput_prompts(count)
    longest_prompt = max(len(tokenizer(p).input_ids) for p in prompts + [case[2] for case in MASK_CASES])
    seqs = max(count, len(MASK_CASES) * MASK_REQUESTS)
    max_len = longest_prompt + max(throughput_tokens, mask_tokens) + 8
    accelerate(model, paged=False)
    engine = Engine(
        model,
        tokenizer,
        max_num_seqs=seqs,
        num_blocks=seqs * -(-max_len // 16) + 8,
        max_num_batched_tokens=max(512, seqs * 32),
        enable_prefix_caching=False,
    )
    masks = [asdict(row) for row in bench_masks(engine, tokenizer, mask_tokens)]
    console.print(
        table(
            f"structured outputs: host mask time per token (fill_next_token_bitmask + accept_token), "
            f"{name}, {MASK_REQUESTS} generations per spec, up to {mask_tokens} tokens",
            masks,
        )
    )
    rows = [asdict(row) for row in bench_throughput(engine, prompts, throughput_tokens)]
    console.print(
        table(
            f"structured outputs: Engine throughput, {name} ({str(dtype).removeprefix('torch.')}, "
            f"{device.type}), {count} requests in one batch, {throughput_tokens} greedy tokens each "
            f"(structured: a JSON array of >= {MIN_ITEMS} records)",
            rows,
        )
    )
    del engine
    gc.collect()
    restore(model)
    return {
        "structured_masks": masks,
        "structured_throughput": rows,
        "structured_specs": {case[0]: json.dumps(case[1]) for case in MASK_CASES}
        | {"throughput": json.dumps(THROUGHPUT_SPEC)},
    }
