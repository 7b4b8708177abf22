"""Batched sampling where every row has its own SamplingParams, on the device, one host copy per step.

Order per row (as vLLM / transformers): repetition, frequency and presence penalties on the logits; greedy
rows take the argmax; the others divide by temperature, keep the top-k, the nucleus (top-p) and the tokens
with at least ``min_p`` times the top probability, renormalise, and draw by inverse CDF with one uniform
number per row. A seeded row draws its number from its own generator, so its tokens do not depend on what
else is in the batch. Log-probabilities are those of the model's distribution after penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hfaccel.engine.params import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    """One row to sample: its params, generator and the tokens the penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """``logits [R, V]`` -> one token per row, and its logprobs where the row asked for them."""
    logits = logits.float()
    logits = _apply_penalties(logits, rows)
    tokens = logits.argmax(-1)  # [R]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = _draw(logits[index], [rows[i] for i in sampled])
    logprobs = _logprobs(logits, tokens, rows)
    return tokens.tolist(), logprobs


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    penalized = [i for i, row in enumerate(rows) if row.params.penalized]
    if not penalized:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in penalized:
        params, row = rows[i].params, rows[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(list(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values < 0, values * params.repetition_penalty,
                                          values / params.repetition_penalty)
        if row.output_ids and (params.frequency_penalty or params.presence_penalty):
            out = torch.tensor(list(row.output_ids), dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).index_add_(0, out, torch.ones_like(out, dtype=torch.float))
            logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def _draw(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Inverse-CDF sampling of ``logits [R, V]`` after each row's temperature / top-k / top-p / min-p."""
    device = logits.device
    temperature = torch.tensor([row.params.temperature for row in rows], device=device)
    probs = torch.softmax(logits / temperature[:, None], -1)
    sorted_probs, order = probs.sort(-1, descending=True)  # [R, V]
    keep = _filter_sorted(sorted_probs, rows)  # a prefix of the sorted tokens
    kept = sorted_probs * keep
    cdf = kept.cumsum(-1)  # [R, V]
    uniform = _uniforms(rows, device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, uniform[:, None], right=True)  # [R, 1]
    pick = torch.minimum(pick, keep.sum(-1, keepdim=True) - 1)  # rounding never reaches a filtered token
    return order.gather(1, pick)[:, 0]


def _filter_sorted(sorted_probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Which of the descending-sorted tokens survive top-k, then top-p over what top-k left (renormalised, as
    transformers' warpers chain), then min-p; the top token always does. The survivors are a prefix."""
    device, vocab = sorted_probs.device, sorted_probs.shape[-1]
    top_k = torch.tensor([row.params.top_k if row.params.uses_top_k else vocab for row in rows], device=device)
    top_p = torch.tensor([row.params.top_p for row in rows], device=device)
    min_p = torch.tensor([row.params.min_p for row in rows], device=device)
    rank = torch.arange(vocab, device=device)[None]
    keep = rank < top_k[:, None]
    in_top_k = sorted_probs * keep
    in_top_k = in_top_k / in_top_k.sum(-1, keepdim=True)
    before = in_top_k.cumsum(-1) - in_top_k  # mass of the more likely tokens, within top-k
    keep &= (before < top_p[:, None]) & (sorted_probs >= min_p[:, None] * sorted_probs[:, :1])
    keep[:, 0] = True
    return keep


def _uniforms(rows: Sequence[SampleRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row: from the row's own generator when seeded, else from the global one."""
    values = torch.rand(len(rows), device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            values[i] = torch.rand(1, device=device, generator=row.generator)[0]
    return values


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleRow]) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits[index], -1)  # [W, V]
    chosen = logprobs.gather(1, tokens[index][:, None])[:, 0].tolist()
    width = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max(width, 1), -1) if width else (None, None)
    for j, i in enumerate(wanted):
        count = rows[i].params.logprobs
        top = {} if not count else dict(zip(top_ids[j, :count].tolist(), top_values[j, :count].tolist()))
        result[i] = TokenLogprob(int(tokens[i]), chosen[j], top)
    return result
