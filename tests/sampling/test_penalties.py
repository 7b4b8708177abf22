"""The penalties' token counts kept on the device (``TokenCounts``): what a step sends up is what is new, the counts
equal counting the whole token lists, rows are cleared and reused, and sampling with them gives the tokens of
sampling without them."""

import random

import pytest
import torch

from hfaccel.sampling import SampleRow, SamplingParams, TokenCounts, sample
from hfaccel.sampling import penalties as penalties_module

VOCAB = 23


def _counted(tokens: list[int]) -> list[float]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).float().tolist()


def test_counts_follow_growing_outputs_with_rows_reused_and_grown(monkeypatch):
    sent = []
    monkeypatch.setattr(
        penalties_module,
        "to_device",
        lambda values, dtype, device: sent.append(len(values)) or torch.tensor(values, dtype=dtype),
    )
    rng = random.Random(0)
    counts = TokenCounts(VOCAB, torch.device("cpu"), rows=1)  # grows as sequences come
    live: dict[str, tuple[list[int], list[int]]] = {}
    for step in range(60):
        if rng.random() < 0.3 or not live:
            live[f"s{step}"] = ([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))], [])
        if len(live) > 1 and rng.random() < 0.2:
            gone = rng.choice(sorted(live))
            counts.release(gone)
            del live[gone]
        keys = rng.sample(sorted(live), rng.randint(1, len(live)))
        new = 0
        for key in keys:
            grown = rng.randrange(3)
            live[key][1].extend(rng.randrange(VOCAB) for _ in range(grown))
            new += grown
        fresh = sum(len(live[key][0]) for key in keys if key not in counts._row)
        rows = counts.rows(keys, [live[k][0] for k in keys], [live[k][1] for k in keys])
        assert sent[-1] == len(keys) + 2 * new + 2 * fresh  # rows, the new output tokens, first-seen prompts
        for key, row in zip(keys, rows.tolist()):
            prompt, output = live[key]
            assert counts.output[row].tolist() == _counted(output) if output else counts.output[row].sum() == 0
            assert counts.prompt[row].tolist() == [t in prompt for t in range(VOCAB)]
        assert len(set(rows.tolist())) == len(keys)
    assert len(counts) == len(live)


def test_a_released_row_is_cleared_and_an_output_never_shrinks():
    counts = TokenCounts(VOCAB, torch.device("cpu"), rows=1)
    (row,) = counts.rows(["a"], [[1, 2]], [[3, 3]]).tolist()
    counts.release("a")
    assert counts.output[row].sum() == 0 and not counts.prompt[row].any()
    assert counts.rows(["b"], [[4]], [[5]]).tolist() == [row]
    with pytest.raises(ValueError, match="has 0 output tokens; 1 were counted"):
        counts.rows(["b"], [[4]], [[]])


def test_sampling_with_kept_counts_equals_counting_every_step():
    """Penalized rows over several steps: the counts kept across calls give the logits (and tokens) of counting
    each row's whole lists every call, with a token in flight counted too."""
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(
            temperature=0, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2, logprobs=5
        ),  # logprobs after the penalties: they show any miscount
        SamplingParams(temperature=0.8, seed=3, repetition_penalty=0.7, logprobs=5),
        SamplingParams(temperature=0),
    ]  # not penalized
    prompts, outputs = [[1, 2, 2], [5], [7, 8]], [[], [], []]
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    for step in range(8):
        logits = torch.randn(3, VOCAB, generator=gen)
        pending = torch.tensor([step % VOCAB, -1, 4]) if step % 2 else None
        rows = [
            SampleRow(p, p.seed, prompt, list(out), counter=len(out), key=i)
            for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs))
        ]
        kept, kept_logprobs = sample(logits, rows, pending, counts).result()
        assert (kept, kept_logprobs) == sample(logits, rows, pending).result()
        for out, token in zip(outputs, kept):
            out.append(token)
    assert len(counts) == 2  # the penalized rows only
