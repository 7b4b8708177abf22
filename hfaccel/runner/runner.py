"""Packed (varlen) forward passes of a Hugging Face model over a paged KV pool, one sequence per request.

:class:`ModelRunner` is what the engine and speculative decoding drive: each forward takes any number of
sequences, each with its own number of new tokens (a whole prompt, a prefill chunk, one decode token, a
draft run to verify), concatenated into one ``[1, T]`` row with per-token positions — no padding anywhere.
The model itself runs unchanged (its attention hfaccel's): its layers hand their new K/V to the runner's
:class:`~hfaccel.kv.SequenceKVCache`, which writes them into the pool by slot mapping and returns a ``PagedKV``
with ``cu_seqlens_q``, so hfaccel's attention runs the paged kernel on the packed queries.

The runner builds each forward's metadata once (:meth:`KVPool.packed_step`). With decode graphs enabled
(:meth:`ModelRunner.enable_decode_graphs`) a forward of one token per sequence runs as a static-shape step
replayed from a CUDA graph (``hfaccel.runner.graphs``), and with catch-up graphs
(:meth:`ModelRunner.enable_catch_up_graphs`) one of a few tokens per sequence too; every other forward runs eagerly.

Each sequence has its own length; ``crop`` rolls a sequence back (rejected draft tokens) without touching
the others or recomputing anything.

With LoRA layers in the model (``runner.lora``: their shared :class:`~hfaccel.lora.LoRAContext`), each sequence of a
forward may name the slot of its adapter (``lora_slots``, -1 for the base model): the runner hands the wrapped layers
the slot of every packed token (``index [T]``, one non-blocking copy), or nothing when no sequence has an adapter.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from hfaccel import compat
from hfaccel.attention import is_image_text_to_text
from hfaccel.attention.masks import packed_mask
from hfaccel.device import model_device, to_device
from hfaccel.kv import KVPool, PackedStep
from hfaccel.kv.hf_cache import PACKED_STEP_KWARG, paged_reader_backend, sequence_cache
from hfaccel.kv.latent import absorbed_layers, install_absorption, release_absorption
from hfaccel.kv.indexer import install_indexers
from hfaccel.kv.state import install_mixers
from hfaccel.lora import LoRAContext
from hfaccel.runner.graphs import DEFAULT_LADDER, DecodeGraphs
from hfaccel.runner.multimodal import prefill_sequence
from hfaccel.sampling.sampler import SampleRow


def packed_token_limit(config) -> int | None:
    """The most tokens one packed forward may hold for it to be exact; None: no limit.

    Llama 4's no-RoPE layers scale their queries by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``: hfaccel's
    attention scales each packed query at its position in its sequence, after transformers scaled it at ``p`` its
    index in the forward plus the cache's one length (``SequenceKVCache`` says 0) — by 1 while ``p + 1 <
    floor_scale``.
    """
    config = config.get_text_config(decoder=True)
    if not getattr(config, "attn_temperature_tuning", False) or 0 not in (
        getattr(config, "no_rope_layers", None) or ()
    ):
        return None
    return int(config.floor_scale) - 1


class ModelRunner:
    """Runs packed forwards of one HF causal LM over a :class:`KVPool`.

    The model's attention must be hfaccel's while the runner is used (``hfaccel.accelerate(model)``, or
    :func:`hfaccel.attention.hfaccel_attention` for the duration of a call).
    """

    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool
        self.device = model_device(model)
        self.cache = sequence_cache(model, pool)
        self.graphs: DecodeGraphs | None = None
        self.catch_up: DecodeGraphs | None = None  # a second static step: a few tokens, the last one's logits
        self.metadata_seconds = 0.0  # host time building the forwards' metadata (``Engine.host_times`` reads it)
        self._lora: LoRAContext | None = None
        self._cache_argument = compat.cache_argument(model)  # "cache" (transformers >= 5.24) or "past_key_values"
        self._mask = packed_mask(model.config.get_text_config(decoder=True))
        # latent layers (MLA) read in the latent space where their module and the pool allow it (hfaccel.kv.latent)
        self.absorbed = absorbed_layers(model, pool.layout, pool.kv_cache_dtype)
        self.cache.absorbed = self.absorbed
        install_absorption(model, self.absorbed, self)
        latent = [layer for layer, kv in pool.layout.attention.items() if kv.latent]
        # the others expand each sequence's latents from the cache, their attention reading the step (and one
        # prompt's whole prefill of every latent layer does)
        self.reads_latents = bool(latent)
        self.expands_latents = any(layer not in self.absorbed for layer in latent)
        # sparse attention's indexers (DeepSeek Sparse Attention) score every key their sequences hold, each forward
        self.indexes_keys = bool(pool.layout.indexers)
        self.max_tokens = packed_token_limit(model.config)  # per forward (None: no limit)
        # a multimodal model's sequences may continue their position ids from past their cache positions (Qwen's M-RoPE
        # after an image): each sequence's offset, set by its multimodal prefill (absent: 0); its steps add them
        self.offsets_positions = is_image_text_to_text(model)
        self.position_offsets: dict[Hashable, int] = {}
        if pool.states is not None:
            install_mixers(model, pool.layout)  # its recurrent layers run per sequence under this runner's cache
        install_indexers(model, pool.layout)  # and its sparse-attention indexers per group of sequences

    def enable_decode_graphs(
        self,
        max_batch: int,
        max_model_len: int,
        *,
        tokens_per_seq: int = 1,
        capture: bool | None = None,
        compile: bool = False,
        ladder: Sequence[int] = DEFAULT_LADDER,
        draws: bool = False,
    ) -> DecodeGraphs:
        """Run forwards of one token per sequence — or, with ``tokens_per_seq > 1``, of up to that many per
        sequence with logits for all of them (speculative verification) — for up to ``max_batch`` sequences of
        up to ``max_model_len`` tokens as static-shape steps: compiled with ``torch.compile`` when ``compile``,
        captured as CUDA graphs per padded batch size when ``capture`` (default: on CUDA); otherwise the same
        static step runs eagerly. ``draws``: the steps can also draw the tokens (``forward(draw=...)``)."""
        self._check_static_size(max_batch * tokens_per_seq)
        self.graphs = DecodeGraphs(
            self,
            max_batch,
            max_model_len,
            tokens_per_seq=tokens_per_seq,
            capture=capture,
            compile=compile,
            ladder=ladder,
            draws=draws,
        )
        return self.graphs

    def enable_catch_up_graphs(
        self,
        max_batch: int,
        max_model_len: int,
        *,
        tokens_per_seq: int = 2,
        capture: bool | None = None,
        compile: bool = False,
        ladder: Sequence[int] = DEFAULT_LADDER,
    ) -> DecodeGraphs:
        """Beside the decode steps, run forwards of up to ``tokens_per_seq`` tokens per sequence with the logits of
        each sequence's last token as static-shape steps too (compiled and captured as the decode steps are): a
        draft model catching up, each speculative step, on the one or two tokens the target accepted."""
        self._check_static_size(max_batch * tokens_per_seq)
        self.catch_up = DecodeGraphs(
            self,
            max_batch,
            max_model_len,
            tokens_per_seq=tokens_per_seq,
            logits_for="last",
            capture=capture,
            compile=compile,
            ladder=ladder,
        )
        return self.catch_up

    def _check_static_size(self, tokens: int) -> None:
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise ValueError(
                f"a static step of {tokens} tokens is more than this model's packed forward is exact "
                f"for ({self.max_tokens} tokens: hfaccel.runner.runner.packed_token_limit)"
            )

    def check_lengths(self, num_new: Sequence[int]) -> None:
        """A ``ValueError`` unless a forward of ``num_new`` tokens per sequence is within :attr:`max_tokens`."""
        limit = self.max_tokens
        if limit is not None and sum(num_new) > limit:
            raise ValueError(
                f"this model's packed forward is exact for up to {limit} tokens "
                f"(hfaccel.runner.runner.packed_token_limit); got {sum(num_new)} tokens in the forward"
            )

    def static_steps(self) -> tuple[DecodeGraphs, ...]:
        """The static steps enabled (decode, then catch-up)."""
        return tuple(graphs for graphs in (self.graphs, self.catch_up) if graphs is not None)

    @torch.inference_mode()
    def forward(
        self,
        seq_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        num_new: Sequence[int],
        *,
        logits_for: str | Sequence[int] = "last",
        starts: Sequence[int] | None = None,
        token_ids: Sequence[Sequence[int]] | None = None,
        lora_slots: Sequence[int] | None = None,
        draw: Sequence[SampleRow] | None = None,
        prompt_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One packed forward; returns logits ``[S, V]`` (``logits_for="last"``: each sequence's last new
        token), ``[T, V]`` (``"all"``: every new token, in packed order) or ``[len(logits_for), V]`` (the last
        new token of the sequences at those indices of ``seq_ids``).

        ``input_ids: [T]`` are the new tokens of every sequence, concatenated in ``seq_ids`` order. Without
        ``starts`` the runner grows each sequence by its new tokens in the pool (starting new ones; ``token_ids``
        lets prompts share prefix blocks); with ``starts`` the caller has allocated the slots and says where each
        sequence's new tokens begin. ``lora_slots``: the LoRA slot of each sequence (-1: none; needs ``self.lora``).
        ``draw``: one sampling row per sequence, for a forward the decode steps serve (:meth:`draws`): each
        sequence's next token drawn inside the step is returned instead of the logits, ``[S]`` int64.
        ``prompt_rows``: packed token indices whose logits follow those ``logits_for`` asks for (a prompt's
        logprobs; ``logits_for`` then a list of sequence indices); such a forward runs eagerly.
        """
        if input_ids.dim() != 1 or input_ids.shape[0] != sum(num_new):
            raise ValueError(
                f"input_ids must be [T] with T = sum(num_new) = {sum(num_new)}; got {tuple(input_ids.shape)}"
            )
        if len(seq_ids) != len(num_new) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"one distinct sequence id per entry of num_new; got {list(seq_ids)}, {list(num_new)}")
        if any(n < 1 for n in num_new):
            raise ValueError(f"every sequence needs at least one new token; got {list(num_new)}")
        if lora_slots is not None and (self.lora is None or len(lora_slots) != len(num_new)):
            raise ValueError(
                f"lora_slots needs the model's LoRA layers (runner.lora) and one slot per sequence; got "
                f"{len(lora_slots)} for {len(num_new)} sequences"
                + ("" if self.lora is not None else " and no LoRA layers")
            )
        if draw is not None and not self.draws(num_new, logits_for, starts):
            raise ValueError(
                "draw needs a forward of one token per sequence, logits for each, served by decode steps "
                f"made with draws=True; got num_new {list(num_new)}, logits_for {logits_for!r}"
                + (
                    ""
                    if starts is None or self._static_serves(starts)
                    else ", and a sequence starting (its recurrent layers' first tokens run eagerly)"
                )
            )
        self.check_lengths(num_new)
        if starts is None:
            self.pool.reserve(seq_ids, num_new, token_ids)
            starts = [self.pool.manager.seq_len(s) - n for s, n in zip(seq_ids, num_new)]
        input_ids = input_ids.to(self.device)
        self.pool.sync_states()
        for graphs in self.static_steps() if self._static_serves(starts) and not prompt_rows else ():
            if graphs.serves(num_new, logits_for):
                extra = {
                    name: value for name, value in (("lora_slots", lora_slots), ("draw", draw)) if value is not None
                }
                return self._static_forward(graphs, seq_ids, input_ids, starts, num_new, extra)
        start = time.perf_counter()
        step = self._with_offsets(self.pool.packed_step(seq_ids, starts, num_new), seq_ids, num_new).to(self.device)
        keep = self._logits_index(step, num_new, logits_for, prompt_rows)
        lora_index = self.lora_index(lora_slots, num_new)
        self.metadata_seconds += time.perf_counter() - start
        return self._eager_forward(input_ids, step, keep, lora_index)

    def _with_offsets(self, step: PackedStep, seq_ids: Sequence[Hashable], num_new: Sequence[int]) -> PackedStep:
        """``step`` with its tokens' position offsets (:attr:`position_offsets`), where a sequence has one."""
        if not self.position_offsets:  # a text model's sequences, or no image prompt among them
            return step
        offsets = [self.position_offsets.get(seq_id, 0) for seq_id in seq_ids]
        if not any(offsets):
            return step
        return replace(step, offsets=torch.tensor(offsets).repeat_interleave(torch.tensor(list(num_new))))

    def _static_forward(
        self,
        graphs: DecodeGraphs,
        seq_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        starts: Sequence[int],
        num_new: Sequence[int],
        extra: dict,
    ) -> torch.Tensor:
        """A forward the static steps ``graphs`` serve (what :meth:`forward` returns)."""
        return graphs.run(seq_ids, input_ids, starts, num_new, **extra)

    def _eager_forward(
        self, input_ids: torch.Tensor, step: PackedStep, keep: torch.Tensor | int, lora_index: torch.Tensor | None
    ) -> torch.Tensor:
        """A forward no static step serves, its metadata built (what :meth:`forward` returns)."""
        return self.run_model(input_ids, step, keep, lora_index)

    def draws(
        self, num_new: Sequence[int], logits_for: str | Sequence[int] = "last", starts: Sequence[int] | None = None
    ) -> bool:
        """Whether :meth:`forward` can draw the tokens of such a forward inside the decode step (``starts``: where
        each sequence's new tokens begin, when known)."""
        return (
            self.graphs is not None
            and self.graphs.draws
            and self.graphs.serves(num_new, logits_for)
            and (starts is None or self._static_serves(starts))
        )

    def _static_serves(self, starts: Sequence[int]) -> bool:
        """Whether a static step may serve sequences starting at ``starts``: always, unless the model keeps
        recurrent state and a sequence starts there (its first tokens run the recurrent layers' prefill path, as
        transformers runs them)."""
        return self.pool.states is None or all(start > 0 for start in starts)

    @property
    def lora(self) -> LoRAContext | None:
        """The model's LoRA layers' context, when it has some (an engine's); it follows the rows of the recurrent
        layers' mixers too (``hfaccel.kv.state``)."""
        return self._lora

    @lora.setter
    def lora(self, context: LoRAContext | None) -> None:
        self._lora = context
        self._follow_mixer_rows()

    def _follow_mixer_rows(self) -> None:
        """Have the LoRA context told the rows of each recurrent mixer call under the runner's cache."""
        self.cache.row_followers = () if self._lora is None else (self._lora,)

    def run_model(
        self,
        input_ids: torch.Tensor,
        step: PackedStep,
        keep: torch.Tensor | int,
        lora_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's forward on packed ``input_ids [T]`` with the step's metadata; logits of the ``keep``
        positions (``0``: all). ``lora_index [T]``: each token's LoRA slot (None: no token takes an adapter)."""
        if paged_reader_backend(self.model.config) is None:
            raise RuntimeError(
                "ModelRunner needs the model's attention to be hfaccel's (got "
                f"{compat.attn_implementation(self.model.config)!r}): hfaccel.accelerate(model), "
                "or hfaccel.attention.hfaccel_attention(model) for the duration of a call"
            )
        self.cache.step = step
        if self.lora is not None:
            self.lora.index = lora_index
        try:
            out = self.model(
                input_ids=input_ids[None],
                attention_mask=self._mask,
                position_ids=step.model_positions[None],
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_argument: self.cache},
                **({PACKED_STEP_KWARG: step} if self.reads_latents else {}),
            )
        finally:
            self.cache.step = None
            if self.lora is not None:
                self.lora.index = self.lora.rows = None
        return out.logits[0]

    @property
    def context_reason(self) -> str | None:
        """Why its static steps run at their batch's context, uncompiled and uncaptured, rather than at their whole
        length (None: they do not): each step reads every token its sequences hold, outside the paged kernel."""
        if self.indexes_keys:
            return "sparse attention's indexer scores every held key, at each step's context"
        if self.expands_latents:
            return "multi-head latent attention expands every held token, at each step's context"
        return None

    def prefill_images(
        self,
        seq_id: Hashable,
        input_ids: torch.Tensor,
        inputs: dict,
        keep: Sequence[int] = (),
        lora_slot: int = -1,
        past_ids: Sequence[int] = (),
    ) -> torch.Tensor:
        """The multimodal prefill of one prompt with images (:func:`hfaccel.runner.multimodal.prefill_sequence`:
        ``input_ids [L]`` of sequence ``seq_id``, its slots held, after the ``past_ids`` it holds, the model's
        ``inputs`` for its images); the logits of its last token then of the rows ``keep``, ``[1 + len(keep), V]``."""
        return prefill_sequence(
            self.model, self, seq_id, input_ids, inputs, keep, lora_slot=lora_slot, past_ids=past_ids
        )

    def lora_index(self, lora_slots: Sequence[int] | None, num_new: Sequence[int]) -> torch.Tensor | None:
        """The LoRA slot of each packed token, ``[T]`` on the device, or None when no sequence has an adapter; the
        slots present go to the context as a host list (the torch reference loops over those only)."""
        present = sorted({slot for slot in lora_slots if slot >= 0}) if lora_slots is not None else []
        if not present:
            return None
        self.lora.slots = present
        return to_device([slot for slot, n in zip(lora_slots, num_new) for _ in range(n)], torch.long, self.device)

    def _logits_index(
        self, step: PackedStep, num_new: Sequence[int], logits_for, prompt_rows: Sequence[int] | None = None
    ) -> torch.Tensor | int:
        if isinstance(logits_for, str):
            if logits_for not in ("last", "all") or prompt_rows:
                raise ValueError(
                    f"logits_for must be 'last', 'all' or sequence indices (with prompt_rows: sequence "
                    f"indices); got {logits_for!r}"
                )
            return step.cu_seqlens_q[1:].long() - 1 if logits_for == "last" else 0  # 0: every position
        ends = list(itertools.accumulate(num_new))
        return to_device([ends[i] - 1 for i in logits_for] + list(prompt_rows or ()), torch.long, self.device)

    def replace_pool(self, make_pool) -> None:
        """Swap in a new pool (a larger one, made by ``make_pool()`` once the old one's memory is given back); the
        decode steps keep their compiled step (the pool's block count is symbolic) and drop their captures."""
        self.pool.release()
        self.pool = make_pool()
        self.cache = sequence_cache(self.model, self.pool)
        self.cache.absorbed = self.absorbed
        self._follow_mixer_rows()
        for graphs in self.static_steps():
            graphs.pool_changed()

    def release(self) -> None:
        """Give back the pool's memory and the decode steps' graphs now (the runner is not used again); without
        it they go when Python's cycle collector next runs (the runner and its graphs refer to each other)."""
        self.graphs = self.catch_up = None
        self.pool.release()
        release_absorption(self.model, self)

    # ------------------------------------------------------------------------------------------ sequences
    def crop(self, seq_id: Hashable, length: int) -> None:
        """Keep the first ``length`` tokens of one sequence (rolled-back tokens are simply overwritten later)."""
        self.pool.manager.crop(seq_id, length)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """A new sequence ``child`` sharing every block of ``parent`` (copy-on-write), at its position offset."""
        self.pool.manager.fork(parent, child)
        if parent in self.position_offsets:
            self.position_offsets[child] = self.position_offsets[parent]

    def free(self, seq_id: Hashable) -> None:
        self.position_offsets.pop(seq_id, None)
        if seq_id in self.pool.manager:
            self.pool.manager.free(seq_id)

    def seq_len(self, seq_id: Hashable) -> int:
        return self.pool.manager.seq_len(seq_id)
