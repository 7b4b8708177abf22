"""``KVPool``: one model's paged KV memory — the tensors, the block manager, and each forward's metadata.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, Hkv, D]``. A block of one layer is ``block_size``
token rows of ``Hkv * D`` contiguous values: the paged kernel's (block, offset, head) address reads whole
``D``-vectors per token, a new token is written as one contiguous row, and a copy-on-write or a memory figure
covers every layer in one indexing operation.

Ownership (as nano-vllm's): whoever decides what to compute (the engine's scheduler, speculative decoding)
allocates through ``pool.manager``; the runner builds each forward's metadata here (:meth:`KVPool.packed_step`)
and the model's layers write through the pool's HF ``Cache`` views (``hfaccel.kv.hf_cache``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields, replace

import torch

from hfaccel.device import model_device, to_device
from hfaccel.kernels.ops import write_kv_op
from hfaccel.kernels.write_kv import KV_QUANT_DTYPES, check_kv_scales as check_pool_takes
from hfaccel.kv.block_manager import BlockCopy, BlockManager, CacheFullError, slot_mapping
from hfaccel.kv.layout import ModelLayout, kv_dims, model_layout, split_latents, uniform_layout, widened
from hfaccel.kv.fp8 import KVScales, check_kv_scales, fill_scales, model_kv_scales, prefill_scales
from hfaccel.kv.state import StatePool, StateStep, state_groups


@dataclass(frozen=True)
class PackedStep:
    """One packed forward's metadata, shared by every layer: sequence ``s`` computes its tokens
    ``[seq_lens[s] - q_len_s, seq_lens[s])``, which are rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of the
    packed input. Padding rows (static-shape steps) have one token each, slot -1 and length 0."""

    slot_mapping: torch.Tensor  # [1, T] int64: pool slot of each new token (-1: write nowhere)
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32: tokens held after this forward
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    max_seq_len: int
    max_q_len: int
    state: StateStep | None = None  # the sequences' state slots, for a model whose layers keep recurrent state
    # [T] int64 added to ``positions`` for the model's position ids (None: none): a multimodal model's text after an
    # image continues from where the image's positions end (Qwen's M-RoPE), not from its cache position
    offsets: torch.Tensor | None = None

    @property
    def model_positions(self) -> torch.Tensor:
        """The position ids the model's forward takes: ``[T]``."""
        return self.positions if self.offsets is None else self.positions + self.offsets

    def to(self, device: torch.device) -> PackedStep:
        """The same metadata on ``device`` (non-blocking copies from pinned memory on CUDA)."""
        moved = {
            f.name: to_device(getattr(self, f.name), getattr(self, f.name).dtype, device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.state is not None:
            moved["state"] = self.state.to(device)
        return replace(self, **moved)


class KVPool:
    """The paged KV memory of one model (module docstring).

    Args:
        layout: what each layer of the model keeps (``hfaccel.kv.layout.model_layout``), or the model's config for a
            model whose layers all keep K/V of one shape (its text config gives layers, KV heads and head dim).
        num_blocks, block_size: the pool's size in blocks of ``block_size`` token slots.
        device, dtype: of the tensors (``dtype``: the keys' and values' as the model computes them); when either is
            None they are allocated by :meth:`allocate`, e.g. from the first keys a layer writes.
        kv_cache_dtype: None (K/V stored in ``dtype``), or ``torch.float8_e4m3fn``: each value stored over its
            layer's per-KV-head scale (``hfaccel.kernels.write_kv``; :attr:`scales`), half the bytes of 16-bit.
        kv_scales: an fp8 pool's scales (``hfaccel.kv.fp8``): None (1.0), a number, ``"prefill"`` (set by each
            layer's first prefill) or ``{layer: [2, Hkv or 1]}``.
        enable_prefix_caching: sequences whose prompts share full leading blocks share those blocks.
        num_kv_heads: with a config, the KV heads per layer this process holds; default the config's (a
            tensor-parallel rank holds its share: :func:`~hfaccel.kv.layout.local_kv_heads`).
        max_num_seqs: for a model whose layers keep recurrent state, how many sequences the pool holds at once (one
            state slot each, ``hfaccel.kv.state``).
    """

    def __init__(
        self,
        layout: ModelLayout | object,
        *,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        enable_prefix_caching: bool = False,
        num_kv_heads: int | None = None,
        max_num_seqs: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        kv_scales: KVScales = None,
    ):
        if not isinstance(layout, ModelLayout):
            layers, heads, head_dim = kv_dims(layout)
            layout = uniform_layout(layers, num_kv_heads or heads, head_dim)
        self.layout = layout
        self.block_size = block_size
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_QUANT_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be None (the model's dtype) or one of {KV_QUANT_DTYPES}; got {kv_cache_dtype}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        kv_scales = check_kv_scales(kv_scales)
        if kv_scales is not None and kv_cache_dtype is None:
            raise ValueError(
                f"kv_scales apply to an fp8 pool (kv_cache_dtype=torch.float8_e4m3fn); this pool stores "
                f"K/V in the model's dtype; got kv_scales={kv_scales!r}"
            )
        self.kv_scales = kv_scales
        self._calibrating: set[int] = set()  # layers whose first prefill sets their scales (kv_scales="prefill")
        # attention layers of one (KV heads, width) share one tensor: group g holds layers_per_group[g] of them; latent
        # layers (MLA) groups of their own, whose key and value rows of a token lie one after the other (allocate)
        groups = sorted({(kv.kv_heads, kv.width, kv.latent) for kv in layout.attention.values()})
        self.group_shapes = [(heads, width) for heads, width, _ in groups]
        self.latent_groups = {group for group, (_, _, latent) in enumerate(groups) if latent}
        self.place: dict[int, tuple[int, int]] = {}  # layer -> (group, index in the group's tensor)
        self.layers_per_group = [0] * len(self.group_shapes)
        for layer in sorted(layout.attention):
            kv = layout.attention[layer]
            group = groups.index((kv.kv_heads, kv.width, kv.latent))
            self.place[layer] = (group, self.layers_per_group[group])
            self.layers_per_group[group] += 1
        self.states = StatePool(layout, max_num_seqs) if layout.states else None
        self.manager = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            state_slots=max_num_seqs if layout.states else 0,
        )
        self.tensors: list[torch.Tensor] | None = None  # per group: [L_g, 2, num_blocks, block_size, Hkv_g, D_g]
        self.scales: list[torch.Tensor] | None = None  # per group of a quantized pool: [L_g, 2, Hkv_g] fp32
        self._given = (None if device is None else torch.device(device), dtype)  # (None: the first keys')
        if device is not None and dtype is not None:
            self.allocate(torch.device(device), dtype)

    @classmethod
    def for_model(
        cls,
        model,
        *,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        kv_scales: KVScales = None,
    ) -> KVPool:
        """A pool on the model's device, in its dtype (K/V stored in ``kv_cache_dtype`` if given, over ``kv_scales``:
        ``hfaccel.kv.fp8``, by default the checkpoint's), laid out as the model's layers keep K/V and state (the KV
        heads this process holds of them); prefix caching only where no layer keeps recurrent state."""
        layout = model_layout(model)
        if kv_cache_dtype is not None and kv_scales is None:
            kv_scales = model_kv_scales(model) or None
        return cls(
            layout,
            num_blocks=num_blocks,
            block_size=block_size,
            device=model_device(model),
            dtype=model.dtype,
            enable_prefix_caching=enable_prefix_caching and not layout.hybrid,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=kv_scales,
        )

    # ------------------------------------------------------------------------------------------ memory
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def num_layers(self) -> int:
        """Layers of the model's cache (those that keep no K/V included)."""
        return self.layout.num_layers

    @property
    def allocated(self) -> bool:
        return self.tensors is not None

    @property
    def device(self) -> torch.device | None:
        return None if self.tensors is None else self._device

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.tensors is None else self._dtype

    @property
    def cache_dtype(self) -> torch.dtype | None:
        """The dtype K/V are stored in (:attr:`dtype` unless ``kv_cache_dtype`` was given)."""
        return self.kv_cache_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype in KV_QUANT_DTYPES

    def allocate_like(self, keys: torch.Tensor) -> None:
        """Allocate the pool on the device and in the dtype it was given, else those of the first ``keys`` written."""
        device, dtype = self._given
        self.allocate(device or keys.device, dtype or keys.dtype)

    def check_takes(self, dtype: torch.dtype) -> None:
        """A ValueError unless keys and values of ``dtype`` can be written into the (allocated) pool: those of its
        own dtype, or any float for an fp8 pool."""
        if not self.quantized:
            check_pool_takes(self.tensors[0], None, None, dtype)

    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        self._device, self._dtype = device, dtype
        shapes = list(zip(self.layers_per_group, self.group_shapes))
        self.tensors = [
            self._group_tensor(layers, heads, width, group in self.latent_groups, device, self.kv_cache_dtype or dtype)
            for group, (layers, (heads, width)) in enumerate(shapes)
        ]
        if self.quantized:
            self.scales = [torch.ones(layers, 2, heads, device=device) for layers, (heads, _) in shapes]
            self._set_scales()
        if self.states is not None:
            self.states.allocate(device)

    def _group_tensor(
        self, layers: int, heads: int, width: int, latent: bool, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """A group's ``[L_g, 2, num_blocks, block_size, Hkv, D]`` zeros; a latent group's stored with each token's key
        and value rows one after the other, so that a token's two latents read as one row ``2 * D`` wide (the
        absorbed attention's keys and values: ``hfaccel.kv.latent``)."""
        if not latent:
            return torch.zeros(layers, 2, self.num_blocks, self.block_size, heads, width, device=device, dtype=dtype)
        stored = torch.zeros(layers, self.num_blocks, self.block_size, 2, heads, width, device=device, dtype=dtype)
        return stored.permute(0, 3, 1, 2, 4, 5)

    def _set_scales(self) -> None:
        """The scales ``kv_scales`` gives (``hfaccel.kv.fp8``): a number everywhere, a checkpoint's per layer, or
        none yet (each layer's first prefill sets them)."""
        given = self.kv_scales
        if given == "prefill":
            self._calibrating = set(self.place)
        elif isinstance(given, float):
            for scales in self.scales:
                scales.fill_(given)
        elif given is not None:
            for layer, layer_scales in given.items():
                if layer in self.place:
                    group, index = self.place[layer]
                    fill_scales(self.scales[group], index, layer_scales)

    def release(self) -> None:
        """Give the pool's memory back (the pool is not used again)."""
        self.tensors = self.scales = None
        if self.states is not None:
            self.states.conv.clear()
            self.states.recurrent.clear()

    def memory_tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds: K/V per group, then the recurrent states."""
        states = self.states.tensors() if self.states is not None else []
        return list(self.tensors or []) + states

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, int]:
        """The tensor ``[L_g, 2, num_blocks, block_size, Hkv, D]`` holding layer ``layer``'s K/V, and its index
        there."""
        if layer not in self.place:
            raise KeyError(f"layer {layer} keeps no K/V in this pool ({self.layout.describe()})")
        group, index = self.place[layer]
        return self.tensors[group], index

    def layer_view(self, layer: int) -> dict:
        """The fields of a :class:`~hfaccel.kv.hf_cache.PagedKV` that say where layer ``layer``'s K/V are held: its
        group's tensor and index there, and for a quantized pool the group's scales and the dtype reads return."""
        tensor, index = self.layer_kv(layer)
        if not self.quantized:
            return dict(kv_cache=tensor, layer=index)
        return dict(kv_cache=tensor, layer=index, kv_scales=self.scales[self.place[layer][0]], dtype=self.dtype)

    def block_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block across all layers, K and V (stored in ``dtype``, default the pool's cache dtype, else
        2-byte)."""
        itemsize = (dtype or self.cache_dtype or torch.float16).itemsize
        return sum(
            layers * 2 * self.block_size * heads * width * itemsize
            for layers, (heads, width) in zip(self.layers_per_group, self.group_shapes)
        )

    def write(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        backend: str = "auto",
        calibrate: bool = True,
    ) -> None:
        """Store ``keys, values [B, S, Hkv, D]`` at ``slots [B, S]`` of one layer (``calibrate=False``: rows a later
        write completes, which an fp8 pool's first prefill does not set its scales from)."""
        view = self.layer_view(layer)
        width = view["kv_cache"].shape[-1]  # the wider of a layer's keys and values: the narrower zero-padded to it
        if self.layout.attention[layer].latent:
            keys, values = split_latents(keys, values, width)
        keys, values = widened(keys, width), widened(values, width)
        if calibrate and not torch.compiler.is_compiling() and layer in self._calibrating:  # compiled steps: never
            self._calibrate(layer, keys, values, slots)  # from the rows as stored
        write_kv_op(keys, values, view["kv_cache"], view["layer"], slots, backend, view.get("kv_scales"))

    def calibrating(self, layer: int) -> bool:
        """Whether ``layer``'s next prefill sets its scales (``kv_scales="prefill"``, none set yet)."""
        return layer in self._calibrating

    def _calibrate(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Set ``layer``'s scales from the first tokens it stores (``kv_scales="prefill"``); a write under CUDA-graph
        capture or one that stores nothing leaves them to the next."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        scales = prefill_scales(keys, values, slots)
        if scales is not None:
            group, index = self.place[layer]
            self.scales[group][index].copy_(scales)
            self._calibrating.discard(layer)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Perform the block manager's copy-on-write copies (every layer, K and V)."""
        if copies:
            src = to_device([c.src for c in copies], torch.long, self.device)
            dst = to_device([c.dst for c in copies], torch.long, self.device)
            for tensor in self.tensors:
                tensor[:, :, dst] = tensor[:, :, src]

    def sync_states(self) -> None:
        """Perform the forks' state copies the block manager holds (before a forward)."""
        if self.states is not None:
            self.states.copy(self.manager.take_state_copies())

    # --------------------------------------------------------------------------------------- sequences
    def reserve(
        self, seq_ids: Sequence[Hashable], num_new: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> None:
        """Grow sequence ``seq_ids[i]`` by ``num_new[i]`` slots (starting it if new), all or nothing.

        ``token_ids`` (the new tokens, per sequence) lets the block manager share prompt prefixes. Raises
        ``CacheFullError`` with nothing changed when the pool cannot hold them.
        """
        manager = self.manager
        needed = sum(
            manager.blocks_to_append(s, n) if s in manager else manager.blocks_needed(n)
            for s, n in zip(seq_ids, num_new)
        )
        if needed > manager.num_free_blocks:
            raise CacheFullError(
                f"{len(seq_ids)} sequences need {needed} more blocks of {self.block_size} "
                f"tokens; the pool has {manager.num_free_blocks} free of {manager.num_blocks}"
            )
        copies: list[BlockCopy] = []
        for i, (seq_id, n) in enumerate(zip(seq_ids, num_new)):
            tokens = None if token_ids is None else token_ids[i]
            if seq_id in manager:
                copies += manager.append(seq_id, n, tokens)
            else:
                manager.add_sequence(seq_id, tokens, num_tokens=None if tokens is not None else n)
        self.copy_blocks(copies)

    def block_tables(
        self, seq_ids: Sequence[Hashable], *, num_rows: int | None = None, width: int | None = None
    ) -> torch.Tensor:
        """Host block tables ``[num_rows, width]`` int32 of the sequences (zero-padded rows and columns)."""
        tables = [self.manager.block_table(s) for s in seq_ids]
        width = width or max((len(t) for t in tables), default=1) or 1
        rows = (num_rows or len(tables)) - len(tables)
        return torch.tensor(
            [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * rows, dtype=torch.int32
        ).view(-1, width)

    def packed_step(
        self,
        seq_ids: Sequence[Hashable],
        starts: Sequence[int],
        num_new: Sequence[int],
        *,
        num_rows: int | None = None,
        table_width: int | None = None,
        tokens_per_seq: int | None = None,
    ) -> PackedStep:
        """Host metadata of a forward computing tokens ``[starts[i], starts[i] + num_new[i])`` of ``seq_ids[i]``,
        whose slots the sequences already hold. ``num_rows`` pads to that many sequences (writing nowhere, seeing
        nothing); ``table_width`` fixes the block tables' width; ``tokens_per_seq`` pads every sequence's tokens to
        that many (padding tokens write nowhere and take the sequence's first position; the sequence's length counts
        them, so each real query keeps its position and sees exactly its keys). Built with host tensor ops (a Python
        loop per token would cost ~1 ms per 4096-token prefill chunk)."""
        for seq_id, start, n in zip(seq_ids, starts, num_new):
            if start < 0 or start + n > self.manager.seq_len(seq_id):
                raise ValueError(
                    f"sequence {seq_id!r} holds {self.manager.seq_len(seq_id)} slots; cannot compute "
                    f"tokens {start}..{start + n}"
                )
        if tokens_per_seq is not None and any(not 1 <= n <= tokens_per_seq for n in num_new):
            raise ValueError(
                f"tokens_per_seq={tokens_per_seq} holds 1 to {tokens_per_seq} new tokens per sequence; "
                f"got {list(num_new)}"
            )
        pad = (num_rows or len(seq_ids)) - len(seq_ids)
        table = self.block_tables(seq_ids, num_rows=len(seq_ids) + pad, width=table_width)  # [S, W]
        start = torch.tensor(list(starts) + [0] * pad, dtype=torch.int64)  # [S]
        real = torch.tensor(list(num_new) + [0] * pad, dtype=torch.int64)  # [S]: tokens that count
        width = torch.full_like(real, tokens_per_seq) if tokens_per_seq else real.clamp(min=1)  # [S]: in the row
        tokens = len(width) * tokens_per_seq if tokens_per_seq else int(width.sum())
        positions, slots, lens, cu = token_metadata(
            table, torch.arange(len(width)), start, real, width, tokens, self.block_size
        )
        return PackedStep(
            slot_mapping=slots[None],
            block_tables=table,
            seq_lens=lens.to(torch.int32),
            cu_seqlens_q=cu.to(torch.int32),
            positions=positions,
            max_seq_len=int(lens.max()) if len(lens) else 0,
            max_q_len=int(width.max()) if len(width) else 0,
            state=self._state_step(seq_ids, starts, num_new, pad, tokens_per_seq),
        )

    def _state_step(self, seq_ids, starts, num_new, pad: int, tokens_per_seq: int | None) -> StateStep | None:
        """The state slots and groups of an eager forward (None for a model without recurrent state)."""
        if self.states is None:
            return None
        if tokens_per_seq is not None:
            raise ValueError(
                "a model whose layers keep recurrent state computes each sequence's own tokens only "
                "(no padded multi-token steps: speculative decoding does not serve it)"
            )
        slots = [self.manager.state_slot(s) for s in seq_ids] + [self.states.scratch] * pad
        return StateStep(torch.tensor(slots), state_groups(slots, list(starts) + [1] * pad, list(num_new) + [1] * pad))


def token_metadata(
    tables: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    real: torch.Tensor,
    width: torch.Tensor,
    tokens: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """The per-token metadata of a packed forward, computed with tensor ops only (on the host for
    :meth:`KVPool.packed_step`, on the device for the decode steps'
    :class:`~hfaccel.kv.device_tables.DeviceBlockTables`).

    Sequence ``s`` (block table ``tables[rows[s]]``) computes ``real[s]`` new tokens from position ``start[s]`` in
    ``width[s] >= real[s]`` packed rows (``tokens`` in all); the rows past ``real[s]`` are padding: they write nowhere
    (slot -1) and take the sequence's first position (a model with learned positions would index past its table at
    the end of its context otherwise), and the sequence's length counts them, so each real query keeps its position
    and sees exactly its keys. A sequence with no real token has length 0 (it sees nothing).

    Returns ``positions [T]`` int64, ``slots [T]`` int64, ``seq_lens [S]`` int64 and ``cu_seqlens_q [S + 1]`` int64.
    """
    cu = torch.zeros(len(width) + 1, dtype=torch.int64, device=width.device)
    torch.cumsum(width, 0, out=cu[1:])  # [S + 1]
    owner = torch.repeat_interleave(
        torch.arange(len(width), device=width.device), width, output_size=tokens
    )  # [T]: sequence of each token
    offset = torch.arange(tokens, device=width.device) - cu[owner]  # [T]: index among its sequence's tokens
    counts = offset < real[owner]  # [T]: a real token
    positions = start[owner] + torch.where(counts, offset, 0)  # [T]
    slots = torch.where(counts, slot_mapping(tables, rows[owner], positions, block_size), -1)  # [T]
    lens = torch.where(real > 0, start + width, 0)  # [S]
    return positions, slots, lens, cu
