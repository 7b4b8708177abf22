"""Speculative decoding: a drafter (``hfaccel.speculative.drafters``: a smaller model, or prompt lookup) proposes
tokens, the target verifies them all in one forward (``hfaccel.speculative.verification``: lossless, and seeded as
the engine is).

Batched: every row is its own sequence of the target's and the draft model's :class:`ModelRunner` (packed
forwards, no padding), so each row accepts its own number of tokens per step, and the rejected tail of a
row is cropped from its KV cache without recomputing anything. The draft model may live on another device
or dtype than the target.

One host read per step: drafting and verification run on the device from what the host already knows (the
rows' tokens, the draft counts; host values go up by non-blocking copies), and the host reads each row's
outcome — its accepted drafts, next token and accepted count — once, in one tensor, at the end of the step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hfaccel.attention import hfaccel_attention
from hfaccel.kv.layout import model_layout
from hfaccel.device import model_device, to_device
from hfaccel.runner import ModelRunner, compiles
from hfaccel.sampling import IncrementalDetokenizer, StopChecker, token_ids
from hfaccel.speculative.drafters import Drafter, ModelDrafter, NgramDrafter
from hfaccel.speculative.runners import SpeculativeRunners
from hfaccel.speculative.verification import SpeculativeSampler, step_outcomes, target_distributions, verify


@dataclass
class SpeculativeStats:
    """What a :func:`speculative_generate` call did (``return_stats=True``)."""

    num_draft_tokens: int
    target_forwards: int = 0  # verification forwards (each serves every active row)
    row_steps: int = 0  # (row, verification) pairs
    proposed: int = 0  # drafted tokens offered for verification
    accepted: int = 0  # drafted tokens the target accepted
    emitted: int = 0  # tokens emitted by verification steps (accepted + one per row-step, before stopping cuts)
    rejections: int = 0  # row-steps that ended on a rejected draft
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    per_row_acceptance: list[float] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def token_acceptance(self) -> float:
        """alpha of Leviathan et al.: how often a drafted token is accepted when all before it were."""
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Mean tokens a row gains per verification forward (1 = no speed-up from drafting)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    def __str__(self) -> str:
        return (
            f"acceptance {self.acceptance_rate:.3f} ({self.accepted}/{self.proposed}), "
            f"{self.tokens_per_target_forward:.2f} tokens per target forward over {self.target_forwards} "
            f"forwards; time prefill {self.prefill_seconds:.3f}s, draft {self.draft_seconds:.3f}s, "
            f"verify {self.verify_seconds:.3f}s"
        )


@dataclass
class Row:
    """One batch row: its tokens (prompt + generated) and where each model's cache stands."""

    index: int
    tokens: list[int]
    prompt_len: int
    budget: int  # max new tokens
    stopper: StopChecker | None = None  # EOS, stop strings, the budget
    finished: bool = False
    proposed: int = 0
    accepted: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        return self.budget - (len(self.tokens) - self.prompt_len)


def _check_stop_strings(stop_strings: str | Sequence[str] | None, tokenizer) -> list[str]:
    strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
    if strings and tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer (tokenizer=...) to read the generated text")
    if any(not isinstance(s, str) or not s for s in strings):
        raise ValueError(f"stop_strings must be non-empty strings; got {strings!r}")
    return strings


def speculative_generate(
    model,
    draft_model=None,
    input_ids: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    num_draft_tokens: int = 4,
    max_new_tokens: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    draft: str = "model",
    ngram_size: int = 3,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer=None,
    seed: int | None = None,
    block_size: int = 16,
    compile: bool | str = "auto",
    runners: SpeculativeRunners | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, SpeculativeStats]:
    """Generate with speculative decoding; returns sequences shaped like ``model.generate``'s output.

    Args:
        model: the target causal LM (any model ``hfaccel.accelerate`` serves; it runs on hfaccel's paged
            attention for the duration of the call if it was not accelerated).
        draft_model: a smaller causal LM with the same vocabulary (any device and dtype), or None with
            ``draft="ngram"``.
        input_ids: ``[B, L]`` prompts, padded (left or right) where ``attention_mask`` is 0.
        num_draft_tokens: tokens drafted per row per step (``k``); the target verifies ``k + 1`` at once.
        max_new_tokens: per row (default: the model's generation config).
        do_sample, temperature, top_p, top_k: as ``generate``; greedy when ``do_sample`` is False.
        draft: ``"model"`` (``draft_model``) or ``"ngram"`` (prompt lookup over the prompt and output so
            far, longest suffix match of at most ``ngram_size`` tokens).
        eos_token_id, pad_token_id: default from the model's generation config; a row stops after EOS and
            is padded with ``pad_token_id``.
        stop_strings, tokenizer: a row also stops after the token that completes one of these strings.
        seed: any int: sampling with the Engine's seeded numbers — row ``i`` draws as completion ``i`` of an Engine
            request with this seed (``hfaccel.speculative.verification``); None: torch's global generator.
        compile: the target's verification steps and the draft model's one-token steps run as the runners'
            static steps (CUDA graphs on CUDA), compiled with ``torch.compile`` when True or ``"auto"`` on CUDA.
        runners: a :class:`SpeculativeRunners` that keeps the runners (pools, compiled and captured steps) for
            the next call; without it they are built for this call and released at its end.
        return_stats: also return :class:`SpeculativeStats`.
    """
    config = model.generation_config
    max_new_tokens = _max_new_tokens(config, max_new_tokens, input_ids)
    rows = _rows(input_ids, attention_mask, max_new_tokens)
    _check_arguments(model, draft_model, draft, num_draft_tokens, rows)
    eos = token_ids(config.eos_token_id if eos_token_id is None else eos_token_id)
    strings = _check_stop_strings(stop_strings, tokenizer)
    for row in rows:
        detokenizer = IncrementalDetokenizer(tokenizer, row.tokens, strings, False) if strings else None
        row.stopper = StopChecker(eos, detokenizer, max_new_tokens)
    sampler = SpeculativeSampler(do_sample, temperature, top_k, top_p, seed)
    stats = SpeculativeStats(num_draft_tokens)
    capacity = [row.prompt_len + row.budget + num_draft_tokens + 1 for row in rows]
    compiles(compile, model_device(model))  # a bad setting raises before any work
    kept, runners = runners is not None, runners or SpeculativeRunners()
    try:
        with hfaccel_attention(model):
            target, draft_runner = runners.get(
                model,
                draft_model if draft == "model" else None,
                len(rows),
                capacity,
                num_draft_tokens,
                block_size,
                compile,
            )
            if draft == "ngram":
                drafter = NgramDrafter(ngram_size, target.device)
                clock = _Clock([target.device], exact=return_stats)
                _decode(rows, target, drafter, sampler, num_draft_tokens, stats, clock)
            else:
                with hfaccel_attention(draft_model):
                    drafter = ModelDrafter(draft_runner, target.device)
                    clock = _Clock([target.device, drafter.runner.device], exact=return_stats)
                    _decode(rows, target, drafter, sampler, num_draft_tokens, stats, clock)
    finally:
        if not kept:
            runners.release()
    stats.per_row_acceptance = [row.accepted / row.proposed if row.proposed else 0.0 for row in rows]
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    if pad is None and eos:
        pad = min(eos)
    sequences = _assemble(input_ids, rows, pad)
    return (sequences, stats) if return_stats else sequences


def _decode(
    rows: list[Row],
    target: ModelRunner,
    drafter: Drafter,
    sampler: SpeculativeSampler,
    k: int,
    stats: SpeculativeStats,
    clock: _Clock,
) -> None:
    start = clock.now()
    _prefill(rows, target)
    stats.prefill_seconds = clock.now() - start
    while active := [row for row in rows if not row.finished]:
        _step(active, target, drafter, sampler, k, stats, clock)


def _step(
    rows: list[Row],
    target: ModelRunner,
    drafter: Drafter,
    sampler: SpeculativeSampler,
    k: int,
    stats: SpeculativeStats,
    clock: _Clock,
) -> None:
    """One verification step of the unfinished ``rows``: draft, verify, and only then read the outcome (the
    step's one host read) to emit each row's tokens and roll both caches back to them."""
    start = clock.now()
    counts = [max(0, min(k, row.remaining - 1)) for row in rows]
    drafts = drafter.propose(rows, counts, sampler)
    middle = clock.now()
    target_probs = target_distributions(target, rows, drafts, sampler)  # [R, K + 1, V]
    verdict = verify(target_probs, drafts, sampler, sampler.keys(rows, target.device))
    outcomes = step_outcomes(drafts.tokens, *verdict).tolist()  # R lists of K + 2
    stats.draft_seconds += middle - start
    stats.verify_seconds += clock.now() - middle
    accepted = [outcome[-1] for outcome in outcomes]
    for row, count, taken, outcome in zip(rows, drafts.counts, accepted, outcomes):
        before = len(row.tokens)
        _emit(row, outcome[: taken + 1])
        row.proposed, row.accepted = row.proposed + count, row.accepted + taken
        target.crop(row.index, before + taken)  # the target saw every draft; the accepted ones stay
        drafter.accept(row, before + taken)
        if row.finished:
            target.free(row.index)
            drafter.free(row)
    stats.target_forwards += 1
    stats.row_steps += len(rows)
    stats.proposed += sum(drafts.counts)
    stats.accepted += sum(accepted)
    stats.rejections += sum(taken < count for taken, count in zip(accepted, drafts.counts))
    stats.emitted += sum(accepted) + len(rows)


def _prefill(rows: list[Row], target: ModelRunner) -> None:
    """Run every prompt but its last token through the target (packed); the first verification feeds the last
    token with the first drafts, so every generated token goes through speculation."""
    ready = [row for row in rows if row.prompt_len > 1]
    if ready:
        flat = to_device([t for row in ready for t in row.tokens[:-1]], torch.long, target.device)
        target.forward([row.index for row in ready], flat, [row.prompt_len - 1 for row in ready])


def _emit(row: Row, tokens: list[int]) -> None:
    """Append tokens to a row until its budget, EOS or a stop string ends it."""
    for token in tokens:
        row.tokens.append(int(token))
        if row.stopper.check(int(token), len(row.tokens) - row.prompt_len) is not None:
            row.finished = True
            return


def _rows(input_ids, attention_mask, max_new_tokens: int) -> list[Row]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(
            f"input_ids must be a [batch, length] tensor of token ids; got "
            f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}; got {tuple(attention_mask.shape)}"
        )
    ids = input_ids.tolist()
    keep = attention_mask.bool().tolist() if attention_mask is not None else [[True] * len(r) for r in ids]
    rows = [Row(i, [t for t, k in zip(r, m) if k], 0, max_new_tokens) for i, (r, m) in enumerate(zip(ids, keep))]
    for row in rows:
        if not row.tokens:
            raise ValueError(f"row {row.index} of input_ids has no tokens (attention_mask is all 0)")
        row.prompt_len = len(row.tokens)
    return rows


def _check_arguments(model, draft_model, draft: str, k: int, rows: list[Row]) -> None:
    if draft not in ("model", "ngram"):
        raise ValueError(f"draft must be 'model' or 'ngram'; got {draft!r}")
    if draft == "model" and draft_model is None:
        raise ValueError("speculative decoding needs a draft_model (or draft='ngram' to draft by prompt lookup)")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1; got {k!r}")
    for role, checked in (("target", model), ("draft", draft_model if draft == "model" else None)):
        reason = None if checked is None else rollback_refusal(checked)
        if reason is not None:
            raise ValueError(f"speculative decoding cannot serve the {role} model: {reason}")
    vocab = vocab_size(model)
    if draft == "model" and vocab_size(draft_model) != vocab:
        raise ValueError(
            f"the draft model's vocabulary ({vocab_size(draft_model)} tokens) differs from the "
            f"target's ({vocab}); speculative decoding needs the same tokenizer and vocabulary"
        )
    top = max(max(row.tokens) for row in rows)
    if top >= vocab or min(min(row.tokens) for row in rows) < 0:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}); got values up to {top}")


def rollback_refusal(model) -> str | None:
    """Why speculative decoding cannot run ``model`` (its rejected drafts are rolled back), or None."""
    if model_layout(model).hybrid:
        return (
            "its layers keep recurrent state (a hybrid model), which cannot be rolled back to the accepted tokens "
            "as K/V can"
        )
    return None


def vocab_size(model) -> int:
    """Rows of the model's output head (what its logits cover)."""
    config = model.config.get_text_config(decoder=True)
    return int(config.vocab_size)


def _max_new_tokens(config, max_new_tokens: int | None, input_ids) -> int:
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
        if max_new_tokens is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            max_new_tokens = config.max_length - input_ids.shape[1]
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    return max_new_tokens


def _assemble(input_ids: torch.Tensor, rows: list[Row], pad: int | None) -> torch.Tensor:
    """``input_ids`` followed by each row's new tokens, padded to the longest with ``pad``."""
    width = max(len(row.generated) for row in rows)
    if pad is None and any(len(row.generated) < width for row in rows):
        raise ValueError("rows finished at different lengths and there is no pad_token_id to pad them with")
    new = [row.generated + [pad] * (width - len(row.generated)) for row in rows]
    return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype, device=input_ids.device)], 1)


class _Clock:
    """Phase timings. Exact ones (statistics asked for) wait for the devices at each reading; otherwise the
    host's clock is read without a sync, so timing never stalls the GPU's queue of work."""

    def __init__(self, devices: list[torch.device], exact: bool):
        self.devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"] if exact else []

    def now(self) -> float:
        for device in self.devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()
