"""Batched sampling where every row has its own SamplingParams, on the device, without waiting for it.

Order per row (as vLLM / transformers): repetition, frequency and presence penalties on the logits; greedy
rows take the argmax; the others draw from the distribution of ``hfaccel.sampling.warpers`` (temperature,
top-k, top-p, min-p) by inverse CDF with one uniform number per row. A seeded row's number is a counter-based
hash of (seed, index of the token in its output) computed on the device (:func:`seeded_uniforms`): its tokens do
not depend on what else is in the batch, on preemption or on scheduling, and no generator state exists to
break a CUDA graph capture. Log-probabilities are those of the model's distribution after penalties.

``sample`` only queues work: host lists reach the device by non-blocking copies and the result stays on the
device (``SampledTokens``) until the engine asks for it, so the engine can queue the next step first. A row
whose previous token is still in flight passes it in ``pending`` (device tensor) for the penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hfaccel.device import to_device
from hfaccel.sampling.params import SamplingParams, TokenLogprob
from hfaccel.sampling.warpers import Warping, inverse_cdf, sorted_distribution


@dataclass
class SampleRow:
    """One row to sample: its params, random stream and the tokens the penalties look at."""

    params: SamplingParams
    seed: int | None  # the row's stream (0 <= seed < 2**63); None: the global generator
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # the output tokens the host knows (see ``pending`` for one more)
    counter: int = 0  # index in the output of the token drawn now (keys a seeded row's number)


@dataclass
class SampledTokens:
    """One step's sampled tokens (and logprobs), on the device until ``result`` is asked for."""

    tokens: torch.Tensor  # [R] int64
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs
    logprob_counts: list[int] = field(default_factory=list)  # top entries each of them wants
    chosen: torch.Tensor | None = None  # [W] logprob of each such row's token
    top_ids: torch.Tensor | None = None  # [W, K]
    top_values: torch.Tensor | None = None  # [W, K]
    _host: list[torch.Tensor | None] | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> SampledTokens:
        """Start copying the results to the host (pinned memory, non-blocking); ``result`` waits for it."""
        tensors = [self.tokens, self.chosen, self.top_ids, self.top_values]
        self._host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        if self.tokens.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        return self

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens and logprobs as Python values (waits for the device: the engine's one wait per step)."""
        if self._host is None:
            self.start_copy()
        if self._ready is not None:
            self._ready.synchronize()
        tokens, chosen, top_ids, top_values = self._host
        tokens = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprob_rows:
            chosen, top_ids, top_values = chosen.tolist(), top_ids.tolist(), top_values.tolist()
            for j, (row, count) in enumerate(zip(self.logprob_rows, self.logprob_counts)):
                logprobs[row] = TokenLogprob(tokens[row], chosen[j], dict(zip(top_ids[j][:count],
                                                                              top_values[j][:count])))
        return tokens, logprobs


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], pending: torch.Tensor | None = None) -> SampledTokens:
    """``logits [R, V]`` -> one token per row (and its logprobs where the row asked for them), on the device.

    ``pending [R]`` (int64, on the device): a token each row has generated that ``output_ids`` does not hold
    yet (still in flight), or -1; the penalties count it.
    """
    logits = logits.float()
    logits = _apply_penalties(logits, rows, pending)
    tokens = logits.argmax(-1)  # [R]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        index = to_device(sampled, torch.long, logits.device)
        tokens[index] = _draw(logits[index], [rows[i] for i in sampled])
    return _with_logprobs(SampledTokens(tokens), logits, rows)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], pending: torch.Tensor | None) -> torch.Tensor:
    """Repetition (on every token of the prompt and output), frequency and presence (on output counts)."""
    penalized = [i for i, row in enumerate(rows) if row.params.penalized]
    if not penalized:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    params = [rows[i].params for i in penalized]
    index = to_device(penalized, torch.long, device)
    counts = _token_counts([rows[i].output_ids for i in penalized], vocab, device)  # [P, V]
    if pending is not None:
        extra = pending[index]  # [P]
        counts.scatter_add_(1, extra.clamp(min=0)[:, None], (extra >= 0).float()[:, None])
    seen = _token_counts([rows[i].prompt_ids for i in penalized], vocab, device) + counts > 0  # [P, V]
    repetition = to_device([p.repetition_penalty for p in params], torch.float, device)[:, None]
    frequency = to_device([p.frequency_penalty for p in params], torch.float, device)[:, None]
    presence = to_device([p.presence_penalty for p in params], torch.float, device)[:, None]
    values = logits[index]  # [P, V]
    values = torch.where(seen, torch.where(values < 0, values * repetition, values / repetition), values)
    values = values - (frequency * counts + presence * (counts > 0).float())
    logits = logits.clone()
    logits[index] = values
    return logits


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float counts of each token in each list (one copy to the device)."""
    rows = [r for r, tokens in enumerate(token_lists) for _ in tokens]
    flat = [t for tokens in token_lists for t in tokens]
    counts = torch.zeros(len(token_lists), vocab, device=device)
    if flat:
        index = to_device([rows, flat], torch.long, device)  # [2, N]
        counts.index_put_((index[0], index[1]), torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _draw(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Inverse-CDF sampling of ``logits [R, V]`` after each row's temperature / top-k / top-p / min-p."""
    warping = Warping.of([row.params for row in rows], logits.shape[-1], logits.device)
    kept, order = sorted_distribution(logits, warping)  # [R, V] each
    pick = inverse_cdf(kept, _uniforms(rows, logits.device))  # [R]
    return order.gather(1, pick[:, None])[:, 0]


def _uniforms(rows: Sequence[SampleRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row: keyed by (seed, counter) when seeded, else from the global generator."""
    values = torch.rand(len(rows), device=device)
    seeded = [i for i, row in enumerate(rows) if row.seed is not None]
    if seeded:
        keys = to_device([[rows[i].seed for i in seeded], [rows[i].counter for i in seeded], seeded], torch.long,
                         device)  # [3, S]: seeds, counters, rows
        values[keys[2]] = seeded_uniforms(keys[0], keys[1])
    return values


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds, constants < 2**31 so int64 products never overflow) of
    ``x`` in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """U[0, 1) float32 numbers, one per (seed, counter) pair (int64 tensors, seeds in [0, 2**63), counters >= 0):
    a counter-based generator — the same pair gives the same number on any device, in any batch."""
    x = _mix32((seeds >> 32) & _M32)
    x = _mix32(x ^ (seeds & _M32))
    x = _mix32(x ^ (counters & _M32))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 random bits: every float32 in [0, 1) step


def _with_logprobs(result: SampledTokens, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampledTokens:
    """Add the log-probability of each chosen token, and the top ones, for the rows that asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = to_device(wanted, torch.long, logits.device)
    logprobs = torch.log_softmax(logits[index], -1)  # [W, V]
    counts = [rows[i].params.logprobs for i in wanted]
    result.logprob_rows, result.logprob_counts = wanted, counts
    result.chosen = logprobs.gather(1, result.tokens[index][:, None])[:, 0]  # [W]
    result.top_values, result.top_ids = logprobs.topk(max(max(counts), 1), -1)  # [W, K]
    return result
