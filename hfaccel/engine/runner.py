"""Packed (varlen) forward passes of a Hugging Face model over a paged KV pool, one sequence per request.

:class:`ModelRunner` is what the engine and speculative decoding drive: each forward takes any number of
sequences, each with its own number of new tokens (a whole prompt, a prefill chunk, one decode token, a
draft run to verify), concatenated into one ``[1, T]`` row with per-token positions — no padding anywhere.
The model itself runs unchanged (its attention patched by hfaccel): its layers hand their new K/V to
:class:`SequenceKVCache`, which writes them into the pool by slot mapping and returns a ``PagedKV`` with
``cu_seqlens_q``, so hfaccel's attention runs the paged kernel on the packed queries.

Each sequence has its own length; ``crop`` rolls a sequence back (rejected draft tokens) without touching
the others or recomputing anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from hfaccel import attention as attention_impl
from hfaccel.block_manager import BlockCopy, BlockManager, CacheFullError
from hfaccel.cache import HFACCEL_ATTENTION_PREFIX, CacheLayerView, PagedKV, kernel_backend, kv_dims
from hfaccel.kernels.write_kv import write_kv
from hfaccel.support import model_device, to_device, unsupported_reason


@dataclass(frozen=True)
class PackedStep:
    """Device tensors describing one packed forward (shared by every layer)."""

    slot_mapping: torch.Tensor  # [1, T] int64: pool slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: tokens held after this forward
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: new tokens of sequence s are rows cu[s]:cu[s+1]
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    max_seq_len: int
    max_q_len: int


class SequenceKVCache(Cache):
    """A ``transformers.Cache`` holding many independent sequences in one block pool (see module docstring).

    ``begin_forward`` reserves the slots of the next forward's tokens; the model's layers then call
    ``update`` with their packed K/V ``[1, Hkv, T, D]``.
    """

    def __init__(self, config, *, num_blocks: int, block_size: int = 16, device: torch.device | str,
                 dtype: torch.dtype, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.config = config
        self.block_size = block_size
        self.num_layers, self.num_kv_heads, self.head_dim = kv_dims(config)
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)  # [L, 2, num_blocks, block_size, Hkv, D]
        self.step: PackedStep | None = None
        super().__init__(layers=[CacheLayerView(self, i) for i in range(self.num_layers)])

    # ------------------------------------------------------------------------------------------ sequences
    def begin_forward(self, seq_ids: Sequence[Hashable], num_new: Sequence[int],
                      token_ids: Sequence[Sequence[int]] | None = None) -> PackedStep:
        """Reserve ``num_new[i]`` slots at the end of sequence ``seq_ids[i]`` (started if new), all or nothing.

        ``token_ids`` (the new tokens, per sequence) lets the block manager share prompt prefixes.
        Raises ``CacheFullError`` with nothing changed when the pool cannot hold them.
        """
        if len(seq_ids) != len(num_new) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"one distinct sequence id per entry of num_new; got {list(seq_ids)}, {list(num_new)}")
        self._reserve(seq_ids, num_new, token_ids)
        starts = [self.manager.seq_len(s) - n for s, n in zip(seq_ids, num_new)]
        return self.prepare(seq_ids, starts, num_new)

    def prepare(self, seq_ids: Sequence[Hashable], starts: Sequence[int], num_new: Sequence[int]) -> PackedStep:
        """The next forward computes tokens ``[starts[i], starts[i] + num_new[i])`` of sequence ``seq_ids[i]``,
        whose slots the caller already holds in the block manager (the engine allocates them itself)."""
        for seq_id, start, n in zip(seq_ids, starts, num_new):
            if start < 0 or start + n > self.manager.seq_len(seq_id):
                raise ValueError(f"sequence {seq_id!r} holds {self.manager.seq_len(seq_id)} slots; cannot compute "
                                 f"tokens {start}..{start + n}")
        self.step = self._packed_step(seq_ids, starts, num_new)
        return self.step

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Perform the block manager's copy-on-write copies (every layer, K and V)."""
        if copies:
            src = to_device([c.src for c in copies], torch.long, self.kv.device)
            dst = to_device([c.dst for c in copies], torch.long, self.kv.device)
            self.kv[:, :, dst] = self.kv[:, :, src]

    def seq_len(self, seq_id: Hashable) -> int:
        return self.manager.seq_len(seq_id)

    def crop(self, seq_id: Hashable, length: int) -> None:
        """Keep the first ``length`` tokens of one sequence (rolled-back tokens are simply overwritten later)."""
        self.manager.crop(seq_id, length)

    def free(self, seq_id: Hashable) -> None:
        if seq_id in self.manager:
            self.manager.free(seq_id)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` sharing every block of ``parent_id`` (copy-on-write on its next append)."""
        self.manager.fork(parent_id, child_id)

    # --------------------------------------------------------------------------------- transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [1, Hkv, T, D] (the packed new tokens of every sequence)
        if self.step is None:
            raise RuntimeError("SequenceKVCache.begin_forward must be called before the model's forward")
        if not str(getattr(self.config, "_attn_implementation", "")).startswith(HFACCEL_ATTENTION_PREFIX):
            raise RuntimeError("SequenceKVCache needs the model's attention to be hfaccel's "
                               f"(got {self.config._attn_implementation!r}); see hfaccel.engine.runner")
        k_pool, v_pool = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        write_kv(key_states.transpose(1, 2), value_states.transpose(1, 2), k_pool, v_pool, self.step.slot_mapping,
                 backend=kernel_backend(self.config))
        step = self.step
        paged = PagedKV(k_pool, v_pool, step.block_tables, step.seq_lens, step.max_seq_len,
                        cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=step.max_q_len)
        return paged, paged

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.step is None else self.step.max_seq_len - self.step.max_q_len

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return (0 if self.step is None else self.step.max_seq_len), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    # --------------------------------------------------------------------------------------- internals
    def _reserve(self, seq_ids, num_new, token_ids) -> None:
        manager = self.manager
        needed = sum(manager.blocks_to_append(s, n) if s in manager else manager.blocks_needed(n)
                     for s, n in zip(seq_ids, num_new))
        if needed > manager.num_free_blocks:
            raise CacheFullError(f"{len(seq_ids)} sequences need {needed} more blocks of {self.block_size} "
                                 f"tokens; the pool has {manager.num_free_blocks} free of {manager.num_blocks}")
        copies: list[BlockCopy] = []
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_new)):
            tokens = None if token_ids is None else token_ids[i]
            if seq_id in manager:
                copies += manager.append(seq_id, n, tokens)
            else:
                manager.add_sequence(seq_id, tokens, num_tokens=None if tokens is not None else n)
        self.copy_blocks(copies)

    def _packed_step(self, seq_ids, starts, num_new) -> PackedStep:
        """The forward's metadata, built with host tensor ops (a Python loop per token would cost ~1 ms per
        4096-token prefill chunk on the host)."""
        size = self.block_size
        tables = [self.manager.block_table(s) for s in seq_ids]
        width = max((len(t) for t in tables), default=1) or 1
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(-1, width)  # [S, W]
        start, new = torch.tensor(starts, dtype=torch.int64), torch.tensor(num_new, dtype=torch.int64)  # [S]
        cu = torch.zeros(len(num_new) + 1, dtype=torch.int64)
        torch.cumsum(new, 0, out=cu[1:])  # [S + 1]
        owner = torch.repeat_interleave(torch.arange(len(num_new)), new)  # [T]: sequence of each new token
        positions = start[owner] + torch.arange(int(cu[-1])) - cu[owner]  # [T]
        slots = table[owner, positions // size] * size + positions % size  # [T]
        lens = start + new
        device = self.kv.device
        return PackedStep(
            slot_mapping=to_device(slots[None], torch.int64, device),
            block_tables=to_device(table, torch.int32, device),
            seq_lens=to_device(lens, torch.int32, device),
            cu_seqlens_q=to_device(cu, torch.int32, device),
            positions=to_device(positions, torch.int64, device),
            max_seq_len=int(lens.max()) if len(num_new) else 0,
            max_q_len=max(num_new, default=0),
        )


class ModelRunner:
    """Runs packed forwards of one HF causal LM over its own :class:`SequenceKVCache`.

    The model's attention must be hfaccel's while the runner is used (``hfaccel.accelerate(model)``, or
    :func:`hfaccel_attention` for the duration of a call).
    """

    def __init__(self, model, *, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        self.model = model
        self.device = model_device(model)
        self.cache = SequenceKVCache(model.config, num_blocks=num_blocks, block_size=block_size, device=self.device,
                                     dtype=model.dtype, enable_prefix_caching=enable_prefix_caching)

    @torch.inference_mode()
    def forward(self, seq_ids: Sequence[Hashable], input_ids: torch.Tensor, num_new: Sequence[int], *,
                logits_for: str | Sequence[int] = "last", starts: Sequence[int] | None = None,
                token_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """One packed forward; returns logits ``[S, V]`` (``logits_for="last"``: each sequence's last new
        token), ``[T, V]`` (``"all"``: every new token, in packed order) or ``[len(logits_for), V]`` (the last
        new token of the sequences at those indices of ``seq_ids``).

        ``input_ids: [T]`` are the new tokens of every sequence, concatenated in ``seq_ids`` order. Without
        ``starts`` the runner grows each sequence by its new tokens (starting new ones); with ``starts`` the
        caller has allocated the slots and says where each sequence's new tokens begin.
        """
        if input_ids.dim() != 1 or input_ids.shape[0] != sum(num_new):
            raise ValueError(f"input_ids must be [T] with T = sum(num_new) = {sum(num_new)}; got "
                             f"{tuple(input_ids.shape)}")
        if any(n < 1 for n in num_new):
            raise ValueError(f"every sequence needs at least one new token; got {list(num_new)}")
        if starts is None:
            step = self.cache.begin_forward(seq_ids, num_new, token_ids)
        else:
            step = self.cache.prepare(seq_ids, starts, num_new)
        keep = self._logits_index(step, num_new, logits_for)
        out = self.model(input_ids=input_ids.to(self.device)[None], position_ids=step.positions[None],
                         past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.cache.step = None
        return out.logits[0]

    def _logits_index(self, step: PackedStep, num_new: Sequence[int], logits_for) -> torch.Tensor | int:
        if isinstance(logits_for, str):
            if logits_for not in ("last", "all"):
                raise ValueError(f"logits_for must be 'last', 'all' or sequence indices; got {logits_for!r}")
            return step.cu_seqlens_q[1:].long() - 1 if logits_for == "last" else 0  # 0: every position
        ends = list(itertools.accumulate(num_new))
        return to_device([ends[i] - 1 for i in logits_for], torch.long, self.device)

    def crop(self, seq_id: Hashable, length: int) -> None:
        self.cache.crop(seq_id, length)

    def free(self, seq_id: Hashable) -> None:
        self.cache.free(seq_id)

    def seq_len(self, seq_id: Hashable) -> int:
        return self.cache.seq_len(seq_id)


@contextmanager
def hfaccel_attention(model, backend: str = "auto"):
    """Run ``model`` with hfaccel's attention for the duration of the block (a no-op if it already does).

    A model that ``hfaccel.accelerate`` cannot serve raises ``ValueError`` saying why. The model's own
    attention implementation is put back on exit.
    """
    current = str(model.config._attn_implementation)
    if current.startswith(HFACCEL_ATTENTION_PREFIX):
        yield model
        return
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot run on hfaccel's paged attention: {reason}")
    attention_impl.register()
    model.set_attn_implementation(attention_impl.ATTENTION_NAMES[backend])
    try:
        yield model
    finally:
        model.set_attn_implementation(current)
