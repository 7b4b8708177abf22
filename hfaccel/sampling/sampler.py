"""Batched sampling where every row has its own SamplingParams, on the device, without waiting for it.

Order per row (as vLLM / transformers): repetition, frequency and presence penalties on the logits; greedy
rows take the argmax; the others draw from the distribution of ``hfaccel.sampling.warpers`` (temperature,
top-k, top-p, min-p) by an exponential race over the vocabulary in token order (:func:`race`): token =
argmax(p_i / e_i), with ``p`` the warped probabilities (0 for filtered tokens) and ``e_i`` independent Exp(1)
noise, picks token ``i`` with probability exactly ``p_i / sum(p)`` (the Gumbel-max trick).

A seeded row's noise is a counter-based hash of (seed, stream, index of the token in the output, token id)
computed on the device (``hfaccel.kernels.keyed_race``: the hash and the race fused in one kernel on CUDA; the
stream is the completion's index among a request's ``n``): no
generator state exists to break a CUDA graph capture, and the drawn token depends on the logits only through
which token wins the race. Float rounding that differs from batch to batch changes it only at a near-tie of
two tokens' ``p_i / e_i`` as close as the rounding — not, as a sorted inverse CDF would, whenever near-equal
probabilities swap places or a cumulative sum moves past the drawn number. So, but for such near-ties, a seeded
row's tokens do not depend on the batch, on preemption or on scheduling (``SamplingParams.seed`` says exactly
what is promised). Unseeded rows race with Exp(1) noise from torch's global generator
(:func:`global_noise`). Speculative decoding draws with the same functions and keys (``purpose`` tells its
acceptance numbers and residual draws apart from the draws). Log-probabilities are those of the model's
distribution after penalties.

A decode step can also draw inside itself (:func:`draw_step`, the same rule on every row without a host list:
``where`` picks greedy, seeded or unseeded per row), so that a static step's CUDA graph ends with the tokens: the
engine does so for rows that need nothing but their token (:func:`draws_in_step`), the step's rows' parameters
brought up with its other metadata (:func:`draw_columns`).

``sample`` only queues work: host lists reach the device by non-blocking copies and the result stays on the
device (``SampledTokens``) until the engine asks for it, so the engine can queue the next step first. A row
whose previous token is still in flight passes it in ``pending`` (device tensor) for the penalties.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from hfaccel.device import to_device
from hfaccel.kernels.keyed_race import keyed_race
from hfaccel.kernels.ops import keyed_race_op
from hfaccel.sampling.params import SamplingParams, TokenLogprob
from hfaccel.sampling.penalties import TokenCounts
from hfaccel.sampling.warpers import Warping, kept_probabilities

# the columns of draw_columns / draw_step, one value per row: how the row draws, its warping, its key
DRAW_COLUMNS = ("kind", "top_k", "seed", "stream", "counter", "temperature", "top_p", "min_p")
GREEDY_ROW, SEEDED_ROW, UNSEEDED_ROW = 0, 1, 2  # the kinds (0, what padding rows hold: the argmax)

# What a seeded number is for (one of its key's parts): a token's draw (the engine's, and speculative decoding's
# drafts and bonus tokens), speculative decoding's acceptance test of a drafted token, its draw after a rejection.
DRAW, ACCEPT, RESIDUAL = 0, 1, 2


@dataclass
class SampleRow:
    """One row to sample: its params, random stream and the tokens the penalties look at."""

    params: SamplingParams
    seed: int | None  # the request's seed (any int, see ``seed_key``); None: the global generator
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # the output tokens the host knows (see ``pending`` for one more)
    counter: int = 0  # index in the output of the token drawn now (keys a seeded row's noise)
    stream: int = 0  # which of the seed's streams: the completion's index among the request's n (keys it too)
    key: Hashable | None = None  # whose token counts the penalties read, with ``sample(counts=...)``
    banned: Sequence[int] = ()  # tokens this row may not draw now (EOS and stop tokens before ``min_tokens``)


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
                logprobs[row] = TokenLogprob(
                    tokens[row], chosen[j], dict(zip(top_ids[j][:count], top_values[j][:count]))
                )
        return tokens, logprobs


def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    pending: torch.Tensor | None = None,
    counts: TokenCounts | None = None,
) -> SampledTokens:
    """``logits [R, V]`` -> one token per row (and its logprobs where the row asked for them), on the device.

    ``pending [R]`` (int64, on the device): a token each row has generated that ``output_ids`` does not hold
    yet (still in flight), or -1; the penalties count it. ``counts``: the penalized rows' token counts kept on the
    device across calls (the engine's; rows keyed by ``SampleRow.key``), so that a call sends up only the tokens
    new since the last; without it they are counted from the rows' token lists for this call alone.
    """
    logits = logits.float()
    logits = _apply_penalties(logits, rows, pending, counts)
    logits = _apply_bias(logits, rows)
    tokens = logits.argmax(-1)  # [R]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        index = to_device(sampled, torch.long, logits.device)
        tokens[index] = _draw(logits[index], [rows[i] for i in sampled])
    return _with_logprobs(SampledTokens(tokens), logits, rows)


def _apply_penalties(
    logits: torch.Tensor, rows: Sequence[SampleRow], pending: torch.Tensor | None, counts: TokenCounts | None
) -> torch.Tensor:
    """Repetition (on every token of the prompt and output), frequency and presence (on output counts)."""
    penalized = [i for i, row in enumerate(rows) if row.params.penalized]
    if not penalized:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    if counts is None:
        counts, keys = TokenCounts(vocab, device, rows=len(penalized)), penalized
    else:
        keys = [rows[i].key for i in penalized]
    table = counts.rows(keys, [rows[i].prompt_ids for i in penalized], [rows[i].output_ids for i in penalized])
    output = counts.output[table]  # [P, V]: a copy, the pending tokens added to it alone
    params = [rows[i].params for i in penalized]
    host = [
        penalized,
        [p.repetition_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.presence_penalty for p in params],
    ]
    index, repetition, frequency, presence = to_device(host, torch.float32, device)  # [4, P]: one copy
    index = index.long()  # row indices, exact in float32
    if pending is not None:
        extra = pending[index]  # [P]
        output.scatter_add_(1, extra.clamp(min=0)[:, None], (extra >= 0).float()[:, None])
    seen = counts.prompt[table] | (output > 0)  # [P, V]
    repetition, frequency, presence = (v[:, None] for v in (repetition, frequency, presence))  # [P, 1] each
    values = logits[index]  # [P, V]
    values = torch.where(seen, torch.where(values < 0, values * repetition, values / repetition), values)
    values = values - (frequency * output + presence * (output > 0).float())
    logits = logits.clone()
    logits[index] = values
    return logits


def _apply_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Each row's ``logit_bias`` added to its logits, and the tokens it may not draw now (``banned``) masked out:
    one upload of (row, token, value) triples for the whole batch."""
    cells = [
        (i, token, float(value)) for i, row in enumerate(rows) for token, value in (row.params.logit_bias or {}).items()
    ]
    cells += [(i, token, float("-inf")) for i, row in enumerate(rows) for token in row.banned]
    if not cells:
        return logits
    where = to_device([[i for i, _, _ in cells], [t for _, t, _ in cells]], torch.long, logits.device)  # [2, C]
    values = to_device([v for _, _, v in cells], torch.float32, logits.device)  # [C]
    return logits.index_put((where[0], where[1]), values, accumulate=True)


def _draw(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Exponential race over ``logits [R, V]`` after each row's temperature / top-k / top-p / min-p -> ``[R]``:
    seeded rows against their keyed noise (:func:`hfaccel.kernels.keyed_race.keyed_race`: one fused kernel on CUDA),
    the others against noise from the global generator."""
    device, vocab = logits.device, logits.shape[-1]
    weights = kept_probabilities(logits, Warping.of([row.params for row in rows], vocab, device))  # [R, V]
    seeded = [i for i, row in enumerate(rows) if row.seed is not None]
    if not seeded:
        return race(weights, global_noise(len(rows), vocab, device))
    keys = to_device(
        [[seed_key(rows[i].seed) for i in seeded], [rows[i].stream for i in seeded], [rows[i].counter for i in seeded]],
        torch.long,
        device,
    )  # [3, S]: seeds, streams, counters
    if len(seeded) == len(rows):
        return keyed_race(weights, keys[0], keys[1], keys[2], DRAW)
    unseeded = [i for i, row in enumerate(rows) if row.seed is None]
    index = to_device(seeded + unseeded, torch.long, device)  # [R]: one upload
    at_seeded, at_unseeded = index[: len(seeded)], index[len(seeded) :]
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)  # [R]
    tokens.index_copy_(0, at_seeded, keyed_race(weights[at_seeded], keys[0], keys[1], keys[2], DRAW))
    drawn = race(weights[at_unseeded], global_noise(len(unseeded), vocab, device))
    return tokens.index_copy_(0, at_unseeded, drawn)


def draws_in_step(params: SamplingParams) -> bool:
    """Whether a row with ``params`` can draw inside a static step (:func:`draw_step`): it needs its token only —
    no penalties (token counts), logprobs, structured outputs (a mask from the host), logit bias or min_tokens (a
    bias and a ban from the host)."""
    return (
        not params.penalized
        and params.logprobs is None
        and params.structured_outputs is None
        and not params.logit_bias
        and not params.min_tokens
    )


def draw_columns(rows: Sequence[SampleRow]) -> list[list[int]]:
    """The host values :func:`draw_step` reads for ``rows`` (:data:`DRAW_COLUMNS`, one list each, int64 values:
    the float parameters as their float32 bit patterns, so that they travel in one int64 upload)."""
    params = [row.params for row in rows]
    kinds = [
        GREEDY_ROW if p.greedy else SEEDED_ROW if row.seed is not None else UNSEEDED_ROW for p, row in zip(params, rows)
    ]
    floats = torch.tensor(
        [[p.temperature or 1.0 for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        dtype=torch.float32,
    ).view(torch.int32)  # [3, R]
    return [
        kinds,
        [p.top_k if p.uses_top_k else 0 for p in params],
        [seed_key(row.seed) if row.seed is not None else 0 for row in rows],
        [row.stream for row in rows],
        [row.counter for row in rows],
        *floats.tolist(),
    ]


def draw_step(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``sample``'s draw for rows that need only their token, with no host work and no branch on values:
    ``logits [R, V]`` and ``columns [len(DRAW_COLUMNS), R]`` (int64, :func:`draw_columns`; all-zero padding rows
    take the argmax) -> ``[R]`` int64. Each row's token is the one ``sample`` picks for it: the argmax (greedy),
    the race against its keyed noise (seeded) or against the global generator's (unseeded)."""
    logits = logits.float()
    kind, top_k, seeds, streams, counters = columns[:5]  # [R] each
    temperature, top_p, min_p = columns[5:].to(torch.int32).view(torch.float32)  # [R] each
    vocab = logits.shape[-1]
    warping = Warping(
        temperature=torch.where(temperature > 0, temperature, 1.0),
        top_k=torch.where(top_k > 0, top_k.clamp_max(vocab), vocab),
        top_p=top_p,
        min_p=min_p,
    )
    weights = kept_probabilities(logits, warping)  # [R, V]
    seeded = keyed_race_op(weights, seeds, streams, counters, DRAW, "auto")
    unseeded = race(weights, global_noise(logits.shape[0], vocab, logits.device))
    return torch.where(kind == GREEDY_ROW, logits.argmax(-1), torch.where(kind == SEEDED_ROW, seeded, unseeded))


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: per row of ``weights [R, V]`` (>= 0, any total, at least one > 0) and Exp(1)
    ``noise [R, V]`` (> 0), the index of the largest ``weights / noise`` -> ``[R]`` int64. Index ``i`` wins with
    probability ``weights[i] / sum(weights)``, never where its weight is 0."""
    return (weights / noise).argmax(-1)


def global_noise(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) race noise ``[rows, vocab]`` (float32, > 0) from torch's global generator of ``device``."""
    noise = torch.empty(rows, vocab, device=device).exponential_()
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # never 0: a weight of 0 must not score 0 / 0


def seed_key(seed: int) -> int:
    """The int64 that keys a seed's numbers: any Python int, modulo 2**64, as a signed 64-bit value."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def _with_logprobs(result: SampledTokens, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampledTokens:
    """Add the log-probability of each chosen token, and the top ones, for the rows that asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = to_device(wanted, torch.long, logits.device)
    return add_logprobs(result, logits[index], result.tokens[index], wanted, [rows[i].params.logprobs for i in wanted])


def add_logprobs(
    result: SampledTokens, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], counts: list[int]
) -> SampledTokens:
    """``result`` with the log-probability of ``tokens [W]`` under ``logits [W, V]`` and the top ``counts[j]``
    alternatives, for its rows ``rows`` (on the device until ``result`` is asked for)."""
    logprobs = torch.log_softmax(logits.float(), -1)  # [W, V]
    result.logprob_rows, result.logprob_counts = rows, counts
    result.chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [W]
    result.top_values, result.top_ids = logprobs.topk(max(max(counts), 1), -1)  # [W, K]
    return result
