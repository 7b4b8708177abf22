"""A multimodal prompt's prefill over the runner's pool: transformers' own forward — the vision encoder, the
projector, the merge of image features into the text, each family's positions and masks (Qwen's 3-D M-RoPE
positions, Gemma 3's bidirectional attention over an image's tokens) — with its K/V written into the runner's
sequences (a :class:`~hfaccel.kv.PromptCache`); the decode steps then run over that pool.

What the decode steps must carry over from the prefill is where each sequence's positions continue: transformers
continues a row's text past the largest position its prompt used (an image spans fewer positions than tokens under
M-RoPE), so each sequence's position offset (``ModelRunner.position_offsets``) is read off the positions the language
model was given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from contextlib import contextmanager

import torch

from hfaccel import compat
from hfaccel.kv import PromptCache

# transformers' names of the pixels a vision encoder reads
PIXEL_INPUTS = frozenset({"pixel_values", "pixel_values_images", "pixel_values_videos", "image_patches"})
Unit = tuple[int, int, str]  # one image's run of placeholder tokens (start, end) and its content hash
# Qwen's M-RoPE position ids as transformers passes them to the language model: [4, B, L], the text positions then the
# temporal, height and width axes
MROPE_WITH_TEXT_ROW = 4


@torch.inference_mode()
def prefill_batch(
    model,
    runner,
    seq_ids: Sequence[Hashable],
    lengths: Sequence[int],
    *,
    input_ids: torch.Tensor,
    generation_config,
    model_kwargs: dict,
) -> torch.Tensor:
    """``generate``'s prefill of the rows of ``input_ids [B, L]`` (left-padded: row ``i`` holds ``lengths[i]`` real
    tokens) through transformers' own prefill, their K/V into the runner's sequences ``seq_ids`` (their slots
    reserved), each sequence's position offset set (``runner.position_offsets``). Returns the logits of each row's
    last token, ``[B, V]``."""
    width = input_ids.shape[1]
    pads = [width - n for n in lengths]
    kwargs = {name: value for name, value in model_kwargs.items() if name not in compat.CACHE_ARGUMENTS}
    kwargs[compat.cache_argument(model)] = PromptCache(model.config, runner.pool, seq_ids, pads)
    with _positions_given(model) as seen:
        logits = compat.transformers_prefill(model, input_ids, generation_config, kwargs).logits[:, -1]
    _set_offsets(runner, seq_ids, lengths, _next_positions(seen, len(seq_ids), width, pads))
    return logits


@torch.inference_mode()
def prefill_sequence(
    model,
    runner,
    seq_id: Hashable,
    input_ids: torch.Tensor,
    inputs: dict,
    keep: Sequence[int] = (),
    lora_slot: int = -1,
    past_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The Engine's prefill of one sequence's tokens ``input_ids [L]`` (its slots held) with its multimodal
    ``inputs`` (the processor's pixel values, image sizes, token types... of its prompt) through the model's forward,
    every token through LoRA slot ``lora_slot`` (-1: none; only the language model has LoRA layers); its position
    offset set. ``past_ids``: the tokens the sequence holds before ``input_ids`` (prefix-cache hits that end before
    its images), which it continues as transformers' chunked prefill does (5.24 on). Returns the logits of its last
    token, then those of the positions ``keep`` (its prompt logprobs', counted in ``input_ids``):
    ``[1 + len(keep), V]``."""
    cache = PromptCache(model.config, runner.pool, [seq_id], [0], past=len(past_ids))
    logits, end = _prefill(model, runner, cache, past_ids, input_ids, inputs, keep, lora_slot)
    _set_offsets(runner, [seq_id], [len(past_ids) + input_ids.shape[0]], [end])
    return logits


@torch.inference_mode()
def prefill_on_blocks(
    model,
    runner,
    block_table: torch.Tensor,
    input_ids: torch.Tensor,
    inputs: dict,
    keep: Sequence[int] = (),
    past_ids: Sequence[int] = (),
) -> torch.Tensor:
    """:func:`prefill_sequence` of a sequence given by its blocks (``block_table [W]``) rather than by an id of the
    runner's pool: what a tensor-parallel follower runs of its leader's multimodal prefill (its position offset
    comes with the leader's later steps)."""
    cache = PromptCache(model.config, runner.pool, [None], [0], block_tables=block_table[None], past=len(past_ids))
    return _prefill(model, runner, cache, past_ids, input_ids, inputs, keep, -1)[0]


def _prefill(
    model,
    runner,
    cache: PromptCache,
    past_ids: Sequence[int],
    input_ids: torch.Tensor,
    inputs: dict,
    keep: Sequence[int],
    lora_slot: int,
) -> tuple[torch.Tensor, int]:
    """The model's forward on one prompt's ``input_ids [L]`` after the ``past_ids`` its sequence holds (none: the
    whole prompt), into ``cache``: the logits of its last token then of ``keep`` (``[1 + len(keep), V]``), and the
    position its next token takes."""
    past, length = len(past_ids), input_ids.shape[0]
    if past:
        forward_inputs = _continuation_inputs(model, cache, past_ids, input_ids, inputs)
    else:
        forward_inputs = {
            "input_ids": input_ids[None],
            "attention_mask": torch.ones_like(input_ids)[None],
            compat.cache_argument(model): cache,
            **inputs,
        }
    rows = torch.tensor([length - 1, *keep], device=input_ids.device) if keep else 1  # logits_to_keep: indices
    with _positions_given(model) as seen, _adapter(runner, runner.lora_index([lora_slot], [length])):
        out = model(**{**forward_inputs, "use_cache": True, "logits_to_keep": rows})
    return out.logits[0], _next_positions(seen, 1, past + length, [0])[0]


def _continuation_inputs(
    model, cache: PromptCache, past_ids: Sequence[int], input_ids: torch.Tensor, inputs: dict
) -> dict:
    """The forward's inputs for ``input_ids [L]`` after the ``past_ids [P]`` that ``cache`` holds, as transformers'
    chunked prefill gives such a chunk: the whole prompt's attention mask and token types, the chunk's rows of the
    position ids ``generate`` makes for the whole prompt (an M-RoPE model's from its images' grids), the encoded
    features of the images in the chunk (those before it are in the cache)."""
    if not compat.continues_multimodal_prompts(model):
        raise ValueError(
            f"{type(model).__name__} under the installed transformers prefills a prompt with images from its first "
            f"token; got {len(past_ids)} tokens held before it (transformers >= 5.24 continues one)"
        )
    past, length = len(past_ids), input_ids.shape[0]
    prompt = torch.cat([torch.tensor(list(past_ids), dtype=input_ids.dtype).to(input_ids.device), input_ids])
    kwargs = {name: value[..., : past + length] if per_token(name) else value for name, value in inputs.items()}
    if "mm_encoder_outputs" in kwargs:
        kwargs["mm_encoder_outputs"] = _chunk_features(model, kwargs["mm_encoder_outputs"], past_ids, input_ids)
    elif held := sum(1 for token in past_ids if token in media_token_ids(model.config)):
        raise ValueError(
            f"a prompt whose images are not encoded beforehand is computed from before its first image; got {past} "
            f"tokens held before the chunk, {held} of them image tokens"
        )
    kwargs["attention_mask"] = torch.ones_like(prompt)[None]  # [1, P + L]
    positions = compat.generation_position_ids(model, prompt[None], kwargs)
    if positions is not None:
        kwargs["position_ids"] = positions[..., past:]
    return compat.prefill_chunk_inputs(model, input_ids[None], cache, kwargs)


def _chunk_features(model, encoded: dict, past_ids: Sequence[int], input_ids: torch.Tensor) -> dict:
    """The encoder's outputs of a prompt's images (per modality, a row per placeholder token) cut to the rows of
    the placeholders in ``input_ids [L]``, which follows ``past_ids`` (as transformers' chunked prefill cuts them)."""
    chunk = {}
    for modality, output in encoded.items():
        placeholder = _placeholder_id(model, modality)
        before = sum(1 for token in past_ids if token == placeholder)
        count = int((input_ids == placeholder).sum())
        if not before or output is None:
            chunk[modality] = output
        elif count:
            rows = _rows(output, before, count)
            if rows is None:
                raise ValueError(f"the installed transformers cannot take part of a prompt's encoded {modality}s")
            chunk[modality] = rows
    return chunk


def _placeholder_id(model, modality: str) -> int | None:
    """The token id whose each occurrence takes one row of the encoder's ``modality`` outputs, as transformers
    reads pre-encoded features (None: the config names none)."""
    return getattr(model.config, f"{modality}_token_id", None)


def _rows(output, start: int, count: int):
    """Rows ``start .. start + count`` of one modality's encoder outputs (a row per placeholder token), in the
    container the model reads them from; None where the installed transformers cannot slice them."""
    return compat.slice_encoded_media(output, torch.arange(start, start + count))


@contextmanager
def _adapter(runner, index: torch.Tensor | None):
    """Each token's LoRA slot (``index [T]``, :meth:`ModelRunner.lora_index`) given to the layers for the duration
    (None: no adapter), as ``ModelRunner.run_model`` gives them."""
    if index is None:
        yield
        return
    runner.lora.index = index
    try:
        yield
    finally:
        runner.lora.index = runner.lora.rows = None


def _set_offsets(runner, seq_ids: Sequence[Hashable], lengths: Sequence[int], ends: Sequence[int]) -> None:
    """Each sequence's position offset: where its positions continue (``ends``) less its length."""
    for seq_id, length, end in zip(seq_ids, lengths, ends):
        if end != length:
            runner.position_offsets[seq_id] = end - length
        else:
            runner.position_offsets.pop(seq_id, None)


@contextmanager
def _positions_given(model):
    """Record the position ids the model's language model is given during the block (a list that gets them, or
    None where the language model derives them itself)."""
    seen: list[torch.Tensor | None] = []

    def record(module, args, kwargs):
        seen.append(kwargs.get("position_ids"))

    handle = model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _next_positions(seen: list[torch.Tensor | None], batch: int, width: int, pads: Sequence[int]) -> list[int]:
    """The position each row's next token takes, as transformers continues it: one past the largest position of the
    row's real tokens (its cache position where the language model derived positions itself)."""
    if not seen or seen[0] is None:
        return [width] * batch
    positions = seen[0].reshape(-1, batch, seen[0].shape[-1])  # [R, B, L]: R = 1 or the M-RoPE axes
    if positions.shape[0] == MROPE_WITH_TEXT_ROW:
        positions = positions[1:]  # the text positions (the mask's) lead the three M-RoPE axes
    return [int(positions[:, row, pad:].max()) + 1 for row, pad in enumerate(pads)]


class MediaOffsets:
    """Where the positions of the text after a prompt's images continue (their offset, 0 for most families; less
    under M-RoPE, where an image spans fewer positions than tokens), keyed by the images' content hash and learned
    from the multimodal prefills that computed them; at most ``size`` kept (least recently used dropped first). A
    prompt whose prefix-cached blocks cover its images computes the text after them at that offset."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._offsets: OrderedDict[str, int] = OrderedDict()

    def record(self, digest: str, offset: int) -> None:
        self._offsets[digest] = offset
        self._offsets.move_to_end(digest)
        while len(self._offsets) > self.size:
            self._offsets.popitem(last=False)

    def get(self, digest: str) -> int | None:
        offset = self._offsets.get(digest)
        if offset is not None:
            self._offsets.move_to_end(digest)
        return offset

    def __contains__(self, digest: object) -> bool:
        return digest in self._offsets


class EncoderCache:
    """The vision encoder's outputs of recent images, keyed by their content hash, at most ``size`` of them (least
    recently used dropped first): a request whose images were encoded before skips the encoder, and the images of one
    step's prompts are encoded in one call where their inputs stack. A prompt whose images are told apart (each its
    own run of placeholders, ``units``) has each image encoded and kept on its own — a chat's next turn encodes only
    its new image — where its processor inputs split by image and each image alone takes its run's rows (else, and
    from the first prompt where that fails, the prompt's images are one entry). Where the installed transformers
    cannot take encoded images (5.17), or not ``ahead`` (a vision tower tensor parallelism shards, whose collectives
    every rank runs together: :func:`hfaccel.distributed.model.shards_beyond_language_model`), every request encodes
    its own in its forward."""

    def __init__(self, size: int = 64, ahead: bool = True):
        self.size, self.ahead = size, ahead
        self.hits = self.misses = self.batches = 0  # batches: encoder calls that served several prompts or images
        self.per_image = True  # until an image alone takes other rows than its run (its encoding depends on others)
        self._outputs: OrderedDict[Hashable, dict] = OrderedDict()

    def inputs(self, model, prompts: Sequence[tuple[str, dict, Sequence[int], Sequence[Unit]]]) -> list[dict]:
        """Each prompt's inputs — given as (its images' content hash, the processor's inputs, the token ids its
        forward runs, its images' runs ``(start, end, content hash)`` where told apart, else none) — with their
        pixels replaced by the encoder's outputs: cached ones taken, the others encoded (:meth:`_encode`) and kept."""
        if not self.ahead or not compat.takes_encoded_media(model):
            return [inputs for _, inputs, _, _ in prompts]
        entries = [self._entries(digest, inputs, ids, units) for digest, inputs, ids, units in prompts]
        found, fresh = {}, {}
        for key, inputs, ids in (entry for prompt in entries for entry in prompt):
            if key in found or key in fresh:
                self.hits += 1
            elif (cached := self._outputs.get(key)) is not None:
                self.hits += 1
                self._outputs.move_to_end(key)
                found[key] = cached
            else:
                self.misses += 1
                fresh[key] = (inputs, ids)
        found.update(self._encode(model, fresh))
        joined = [_joined([found[key] for key, _, _ in prompt]) for prompt in entries]
        split = [(prompt, output) for prompt, output in zip(entries, joined) if len(prompt) > 1]
        if any(output is None or not all(_fills(model, found[k], ids) for k, _, ids in p) for p, output in split):
            self.per_image = False  # an image alone took other rows: from now on each prompt's images are one entry
            return self.inputs(model, prompts)
        return [
            {**{k: v for k, v in inputs.items() if k not in PIXEL_INPUTS}, "mm_encoder_outputs": output}
            for (_, inputs, _, _), output in zip(prompts, joined)
        ]

    def _entries(self, digest: str, inputs: dict, ids: Sequence[int], units: Sequence[Unit]) -> list[tuple]:
        """What a prompt's encoding is kept as: ``(key, encoder inputs, token ids)`` per image where
        :attr:`per_image` and its inputs split so (:func:`_per_image`), keyed by the image's hash and its run's
        length; else one entry, its images' hash."""
        split = _per_image(inputs, len(units)) if self.per_image and units else None
        if split is None:
            return [(digest, inputs, ids)]
        return [((image, end - start), alone, ids[start:end]) for (start, end, image), alone in zip(units, split)]

    def _encode(self, model, fresh: dict[Hashable, tuple[dict, Sequence[int]]]) -> dict[Hashable, dict]:
        """The encoder's outputs of each prompt's images, kept. Prompts whose inputs stack (:func:`_stack_key`) are
        encoded in one call, each given the rows of its placeholder tokens in order (as transformers reads
        pre-encoded features: row i fills the i-th placeholder); the others each alone."""
        groups: dict[tuple, list[str]] = {}
        for digest, (inputs, _) in fresh.items():
            groups.setdefault(_stack_key(inputs), []).append(digest)
        encoded = {}
        for digests in groups.values():
            outputs = None
            if len(digests) > 1:
                batch = {
                    name: torch.cat([fresh[d][0][name] for d in digests])
                    for name in _encoder_inputs(fresh[digests[0]][0])
                }
                outputs = _split(model, compat.encode_media(model, batch), [fresh[d][1] for d in digests])
                self.batches += outputs is not None
            if outputs is None:
                outputs = [compat.encode_media(model, fresh[d][0]) for d in digests]
            encoded.update(zip(digests, outputs))
        for digest in fresh:
            self._outputs[digest] = encoded[digest]
        while len(self._outputs) > self.size:
            self._outputs.popitem(last=False)
        return encoded

    def __str__(self) -> str:
        return (
            f"{len(self._outputs)} of {self.size} held, {self.hits} hits, {self.misses} misses, "
            f"{self.batches} batched encodes"
        )


IMAGE_TOKEN_NAMES = ("image_token_id", "image_token_index")


MEDIA_TOKEN_NAMES = (*IMAGE_TOKEN_NAMES, "video_token_id", "audio_token_id")


def media_token_ids(config, names: Sequence[str] = MEDIA_TOKEN_NAMES) -> frozenset[int]:
    """The placeholder token ids an image-text-to-text model's config names (image, video, audio; those of
    ``names``)."""
    return frozenset(value for name in names if isinstance(value := getattr(config, name, None), int))


def per_token(name: str) -> bool:
    """Whether a processor's output of this name has one entry per prompt token (its token types)."""
    return name.endswith("token_type_ids")


def _per_image(inputs: dict, count: int) -> list[dict] | None:
    """A prompt's encoder inputs as each of its ``count`` images' alone, or None where they do not split so: Qwen's
    flattened patches by each image's grid (``image_grid_thw``), else every input whose first dimension counts the
    images."""
    names = _encoder_inputs(inputs)
    others = [inputs[name] for name in names if name != "pixel_values"]
    if "pixel_values" not in names or any(value.dim() == 0 or value.shape[0] != count for value in others):
        return None
    grids = inputs.get("image_grid_thw")
    if grids is not None:
        sizes = [int(size) for size in grids.prod(-1)]
        if sum(sizes) != inputs["pixel_values"].shape[0]:
            return None
        pixels = inputs["pixel_values"].split(sizes)
    elif inputs["pixel_values"].shape[0] == count:
        pixels = inputs["pixel_values"].split(1)
    else:
        return None
    return [
        {name: pixels[i] if name == "pixel_values" else inputs[name][i : i + 1] for name in names} for i in range(count)
    ]


def _fills(model, output: dict | None, ids: Sequence[int]) -> bool:
    """Whether an encoder output (per modality) has a row for each placeholder token of ``ids``, and no more."""
    return output is not None and all(
        (placeholder := _placeholder_id(model, modality)) is not None
        and compat.encoded_rows(encoded) == sum(1 for token in ids if token == placeholder)
        for modality, encoded in output.items()
    )


def _joined(outputs: Sequence[dict]) -> dict | None:
    """Several entries' encoder outputs (per modality) as one prompt's, their rows in order; None where an entry has
    none or the installed transformers cannot join them."""
    if len(outputs) == 1:
        return outputs[0]
    if any(output is None for output in outputs):
        return None
    modalities = {modality for output in outputs for modality in output}
    joined = {}
    for modality in modalities:
        if any(modality not in output for output in outputs):
            return None
        joined[modality] = compat.join_encoded_media([output[modality] for output in outputs])
    return joined


def _encoder_inputs(inputs: dict) -> list[str]:
    """The names of a prompt's processor inputs its encoder reads: all but its per-token ones (token types)."""
    return sorted(name for name in inputs if not per_token(name))


def _stack_key(inputs: dict) -> tuple:
    """What prompts' encoder inputs must share to be encoded as one batch, each tensor concatenated along its first
    dimension (images, patches, grids, sizes): the names, and each tensor's shape past that dimension and dtype
    (images a processor padded to its own batch's size differ there)."""
    if any(inputs[name].dim() == 0 for name in inputs):  # a scalar: nothing to concatenate along
        return (id(inputs),)
    return tuple((name, tuple(inputs[name].shape[1:]), inputs[name].dtype) for name in _encoder_inputs(inputs))


def _split(model, outputs: dict, token_ids: Sequence[Sequence[int]]) -> list[dict] | None:
    """One batch's encoder outputs (per modality) as each prompt's: the rows of its placeholder tokens of that
    modality, counted in ``token_ids``; None where they cannot be split so (no placeholder id in the config, no
    slicing in the installed transformers, or placeholders that do not match the features)."""
    per_prompt: list[dict] = [{} for _ in token_ids]
    for modality, output in outputs.items():
        placeholder = _placeholder_id(model, modality)
        if placeholder is None:
            return None
        counts = [sum(1 for token in ids if token == placeholder) for ids in token_ids]
        if sum(counts) != compat.encoded_rows(output):
            return None
        start = 0
        for prompt, count in zip(per_prompt, counts):
            if count:
                rows = _rows(output, start, count)
                if rows is None:
                    return None
                prompt[modality] = rows
            start += count
    return per_prompt
