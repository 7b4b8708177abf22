"""Sparse attention's indexers (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5, ...) in hfaccel's packed forwards.

A sparse-attention layer's *indexer* scores, for each query, every key its sequence holds (by lightweight keys of its
own, which the pool keeps in the layer's latent rows: ``AttentionKV.indexer_dim``) and picks the ``index_topk``
best; the layer's attention then reads only those. The indexer stays transformers' code. A packed forward holds every
sequence's new tokens in one row (``[1, T]``), which the indexer would score as one sequence against all of them, so
each indexer module (found by ``hfaccel.kv.layout``) is given a forward of this instance (:func:`install_indexers`)
that, under hfaccel's :class:`~hfaccel.kv.SequenceKVCache`, runs transformers' own forward once per group of
sequences computing as many new tokens (``[G, n, H]``; a decode step's rows ``[B, 1, H]`` in one group), with a mask
``[G, n, L]`` of the keys each query sees and a cache view (:class:`IndexerGroup`) whose ``update_indexer`` stores
the group's new keys and returns the keys its sequences hold, ``[G, L, D]``. The choice comes back as each packed
query's positions in its own sequence, ``[1, T, topk]`` (-1: none), which hfaccel's attention reads
(``hfaccel.attention.functions``). Under any other cache (a prompt's prefill through the model's forward,
transformers' loop) the indexer runs as it is, over keys in transformers' layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hfaccel.kv.hf_cache import SequenceKVCache
from hfaccel.kv.layout import ModelLayout, unwrap_forwards, wrap_forwards
from hfaccel.kv.pool import PackedStep

INDEXER_FORWARD = "hfaccel_indexer"  # the attribute marking an indexer's forward as hfaccel's (install_indexers)
NO_KEY = -1  # a packed query's chosen position where it has fewer keys than the others
# the most bytes one call of an indexer may score (its fp32 scores and transformers' two copies of them, each query
# against every key its sequence holds, and the keys read): its queries run in calls below it
INDEXER_BYTES = 1 << 28


@dataclass(frozen=True)
class IndexGroup:
    """Sequences of one packed forward whose indexer runs together: ``len(sequences)`` of ``length`` new tokens
    each, at packed rows ``tokens`` (sequence by sequence), holding at most ``held`` keys each."""

    tokens: torch.Tensor  # [G * length] int64: rows of the packed forward
    sequences: torch.Tensor  # [G] int64: the sequences' indices in the step
    length: int
    held: int


def index_groups(step: PackedStep) -> tuple[IndexGroup, ...]:
    """The forward's sequences grouped by their count of new tokens: one group, at the step's ``max_seq_len``, when
    every sequence has the step's ``max_q_len`` (a decode or verify step: no host read), else by the counts and
    lengths read from the step (one read)."""
    device = step.positions.device
    count = step.cu_seqlens_q.shape[0] - 1
    tokens = step.positions.shape[0]
    if tokens == count * step.max_q_len:
        every = torch.arange(count, device=device)
        return (IndexGroup(torch.arange(tokens, device=device), every, step.max_q_len, step.max_seq_len),)
    read = torch.cat([step.cu_seqlens_q.long(), step.seq_lens.long()]).tolist()
    bounds, lengths = read[: count + 1], read[count + 1 :]
    by_length: dict[int, list[int]] = {}
    for sequence, (first, last) in enumerate(zip(bounds, bounds[1:])):
        by_length.setdefault(last - first, []).append(sequence)
    return tuple(
        IndexGroup(
            torch.tensor([bounds[s] + i for s in members for i in range(length)], device=device),
            torch.tensor(members, device=device),
            length,
            max(lengths[s] for s in members),
        )
        for length, members in sorted(by_length.items())
    )


def calls(group: IndexGroup, per_query: int) -> Iterator[IndexGroup]:
    """The group in calls of at most :data:`INDEXER_BYTES` (``per_query`` bytes a query): whole sequences where one
    sequence's queries fit, else runs of one sequence's queries (in order: a query's keys are its own and earlier
    tokens', stored by the calls before it)."""
    count, length = group.sequences.shape[0], group.length
    if length * per_query <= INDEXER_BYTES:
        together = max(1, INDEXER_BYTES // (length * per_query))
        for first in range(0, count, together):
            rows = group.tokens[first * length : (first + together) * length]
            yield IndexGroup(rows, group.sequences[first : first + together], length, group.held)
        return
    run = max(1, INDEXER_BYTES // per_query)
    for sequence in range(count):
        for first in range(0, length, run):
            rows = group.tokens[sequence * length + first : sequence * length + min(first + run, length)]
            yield IndexGroup(rows, group.sequences[sequence : sequence + 1], rows.shape[0], group.held)


class IndexerGroup:
    """The cache an indexer sees for one call (:class:`IndexGroup`) of a packed forward: ``update_indexer`` stores
    the call's new indexer keys ``[G, n, D]`` and returns those its sequences hold, ``[G, held, D]``."""

    def __init__(self, cache: SequenceKVCache, group: IndexGroup):
        self.cache, self.group = cache, group
        self.stored: torch.Tensor | None = None  # the keys it stored, [G * n, D]

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.stored = indexer_keys.reshape(-1, indexer_keys.shape[-1])
        self.cache.store_indexer_keys(layer_idx, self.stored, self.group.tokens, calibrate=False)
        return self.cache.indexer_keys(layer_idx, self.group.sequences, self.group.held)


def install_indexers(model, layout: ModelLayout) -> None:
    """Give each indexer of ``layout`` hfaccel's forward (module docstring; idempotent). :func:`remove_indexers`
    takes it away."""
    wrap_forwards(model, layout.indexers, INDEXER_FORWARD, _indexer_forward)


def remove_indexers(model) -> None:
    """Undo :func:`install_indexers`."""
    unwrap_forwards(model, INDEXER_FORWARD)


def _indexer_forward(layer: int, original, arguments: dict, args: tuple, kwargs: dict) -> torch.Tensor:
    """One indexer call (``arguments``: the call's, by name): per group of sequences under hfaccel's packed cache
    (module docstring), in calls of at most :data:`INDEXER_BYTES`, else transformers' as it is."""
    cache_name = next(
        (name for name, value in arguments.items() if isinstance(value, SequenceKVCache) and value.step is not None),
        None,
    )
    if cache_name is None:
        return original(*args, **kwargs)
    cache = arguments[cache_name]
    step = cache.step
    tokens = step.positions.shape[0]
    groups = cache.per_step.get("index_groups") or cache.per_step.setdefault("index_groups", index_groups(step))
    heads = getattr(original.__self__, "n_heads", 1)
    per_key = (3 * heads + cache.pool.layout.attention[layer].indexer_dim) * 4  # scores, two copies; the keys read
    chosen = keys = None
    done = False
    try:
        for group in groups:
            for call in calls(group, per_key * group.held):
                view = IndexerGroup(cache, call)
                grouped = {name: _grouped(value, call, tokens) for name, value in arguments.items()}
                grouped[cache_name] = view
                grouped["attention_mask"] = _call_mask(step, call)
                picked = original(**grouped)  # [G, n, topk]: positions in each sequence
                picked = picked.reshape(-1, picked.shape[-1])
                if chosen is None:
                    chosen = picked.new_full((tokens, picked.shape[-1]), NO_KEY)
                    keys = view.stored.new_empty(tokens, view.stored.shape[-1])
                elif picked.shape[-1] > chosen.shape[-1]:  # a group of longer sequences chose more
                    chosen = torch.nn.functional.pad(chosen, (0, picked.shape[-1] - chosen.shape[-1]), value=NO_KEY)
                chosen[call.tokens, : picked.shape[-1]] = picked
                keys[call.tokens] = view.stored
        done = True
    finally:
        cache.end_indexer(layer, keys if done else None)
    return chosen[None]


def _grouped(value, group: IndexGroup, tokens: int):
    """An indexer argument for one call: a packed tensor ``[1, T, ...]`` as ``[G, n, ...]`` (tuples of them each),
    anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, tokens):
        rows = value[0].index_select(0, group.tokens)
        return rows.view(-1, group.length, *value.shape[2:])
    if isinstance(value, (tuple, list)):
        return type(value)(_grouped(item, group, tokens) for item in value)
    return value


def _call_mask(step: PackedStep, group: IndexGroup) -> torch.Tensor:
    """``[G, n, held]`` bool: the keys each of the call's queries sees (:func:`sees`)."""
    positions = step.positions[group.tokens].view(-1, group.length)  # [G, n]
    keys = torch.arange(group.held, device=positions.device)  # [held]
    return sees(keys, positions[..., None], step.seq_lens[group.sequences][:, None, None])


def sees(keys: torch.Tensor, positions: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Whether a query at ``positions`` of a sequence holding ``held`` keys sees its keys at ``keys`` (broadcast):
    those up to its own position (packed sequences: each query's own sequence's keys)."""
    return (keys >= 0) & (keys <= positions) & (keys < held)
