"""Prompts with images for the Engine: the model's processor turns a prompt and its images into token ids and the
inputs its vision encoder reads; the engine keeps those with the request and hands them to the multimodal prefill
(``hfaccel.hf.multimodal.prefill_sequence``).

An image is a ``PIL.Image``, encoded bytes (PNG, JPEG, ...) or a path. A prompt with images is
``{"prompt": text_or_messages, "images": [...]}`` — a text prompt with the processor's image placeholders, or chat
messages whose ``{"type": "image"}`` parts take the images in order — or chat messages whose image parts carry
their image (``{"type": "image", "image": ...}``); a prompt a processor made already is
``{"prompt_token_ids": [...], "multimodal_inputs": {...}}``.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hfaccel.runner.multimodal import IMAGE_TOKEN_NAMES, media_token_ids, per_token

# Limits on what one request may bring (the server's defaults; a larger image is refused, not resized)
MAX_IMAGES = 16
MAX_IMAGE_PIXELS = 8192 * 8192


@dataclass(frozen=True)
class MediaInputs:
    """One prompt's multimodal inputs, as its processor made them (batch of one)."""

    inputs: dict[str, torch.Tensor]  # pixel values, image sizes, token types... (not input_ids / attention_mask)
    digest: str  # the images' content hash
    image_digests: tuple[str, ...] = ()  # each image's content hash, in order (empty: not known one by one)
    start: int | None = None  # its first image token (None: not located)
    end: int | None = None  # how many prompt tokens run up to its last image token (None: not located)
    spans: tuple[tuple[int, int], ...] = ()  # each image's tokens (start, end), where located one by one

    def located(self, prompt_ids: Sequence[int], config) -> MediaInputs:
        """These inputs with :attr:`start` and :attr:`end` found in the prompt: its first placeholder token (image,
        video... as the model's ``config`` names them) and one past its last; None when the prompt has none. Each
        image's :attr:`spans` too, where the placeholders are image ones forming one run per image (each image has
        a run at least: an image tiled into several runs, or two images' runs that touch, make another count, and
        the images are not told apart)."""
        media_ids, image_ids = media_token_ids(config), media_token_ids(config, IMAGE_TOKEN_NAMES)
        runs: list[tuple[int, int]] = []  # (start, end) of each run of image placeholders
        found = [i for i, token in enumerate(prompt_ids) if token in media_ids]
        if not found:
            return replace(self, start=None, end=None, spans=())
        for i in found:
            if prompt_ids[i] not in image_ids:
                runs = []  # a video's or audio's placeholders: their content is in no image's hash
                break
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        spans = tuple(runs) if len(runs) == len(self.image_digests) else ()
        return replace(self, start=found[0], end=found[-1] + 1, spans=spans)

    @property
    def units(self) -> tuple[tuple[int, int, str], ...]:
        """The prompt's image tokens as the runs computed whole, ``(start, end, content hash)``: each image's where
        located one by one, else all of them as one (none where not located). A run's K/V depend on its content
        and on its length (a processor may encode an image in fewer tokens beside others: LLaVA-OneVision)."""
        if self.spans:
            return tuple((start, end, digest) for (start, end), digest in zip(self.spans, self.image_digests))
        return () if self.start is None else ((self.start, self.end, self.digest),)

    def images_from(self, start: int) -> bool:
        """Whether computing the prompt from token ``start`` on computes some of its images (the multimodal prefill
        does): ``start`` is before :attr:`end` (not located: only the prompt's first token)."""
        return start == 0 if self.end is None else start < self.end

    def for_tokens(self, length: int) -> dict[str, torch.Tensor]:
        """The inputs for a forward over the prompt and ``length - prompt length`` tokens after it (a preempted
        sequence computed again): per-token inputs (token types) extended with zeros, "text"."""
        inputs = dict(self.inputs)
        for name, value in self.inputs.items():
            if per_token(name) and value.shape[-1] < length:
                inputs[name] = torch.nn.functional.pad(value, (0, length - value.shape[-1]))
        return inputs


def is_processor(tokenizer) -> bool:
    """Whether the Engine was given a multimodal processor (it has an image processor and a tokenizer)."""
    return hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer")


def load_image(image, what: str):
    """A ``PIL.Image`` (RGB) of an image given as a PIL image, encoded bytes or a path; a ValueError naming ``what``
    when it cannot be read or is larger than :data:`MAX_IMAGE_PIXELS`."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        loaded = image
    elif isinstance(image, (bytes, bytearray, str, os.PathLike)):
        source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
        try:
            with Image.open(source) as opened:
                if opened.width * opened.height > MAX_IMAGE_PIXELS:
                    raise ValueError(
                        f"{what} is {opened.width}x{opened.height} pixels; at most {MAX_IMAGE_PIXELS} are taken"
                    )
                loaded = opened.convert("RGB")
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
            raise ValueError(f"{what} is not an image that can be decoded ({type(error).__name__}: {error})") from None
    else:
        raise ValueError(f"{what} must be a PIL image, encoded image bytes or a path; got {type(image).__name__}")
    if loaded.width * loaded.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{what} is {loaded.width}x{loaded.height} pixels; at most {MAX_IMAGE_PIXELS} are taken")
    return loaded if loaded.mode == "RGB" else loaded.convert("RGB")


def process(processor, prompt, images: Sequence | None, **template) -> tuple[str, list[int], MediaInputs | None]:
    """(prompt text, token ids, multimodal inputs or None without images) of a prompt with images (module
    docstring), made by the model's ``processor`` (``template``: chat-template arguments for messages: ``tools``,
    ``add_generation_prompt``, ...); a ValueError saying what is wrong."""
    images = list(images or ())
    if isinstance(prompt, str):
        loaded = [load_image(image, f"image {i}") for i, image in enumerate(images)]
        _check_count(loaded)
        try:
            out = processor(text=[prompt], images=loaded or None, return_tensors="pt")
        except Exception as error:  # the processor's own checks (placeholders and images that do not match...)
            raise ValueError(f"the processor rejected the prompt and its {len(loaded)} images: {error}") from None
        ids = _token_ids(out)
        placeholder = getattr(processor, "image_token_id", None)
        if not loaded and placeholder is not None and placeholder in ids:
            raise ValueError(
                "the processor rejected the prompt and its 0 images: the prompt has image placeholders "
                "and no image was given"
            )
        return prompt, ids, _media(out, loaded)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages, loaded = _messages_with_images(prompt, images)
        _check_count(loaded)
        template = {"add_generation_prompt": True, **template}
        try:  # the text (for the caller), then transformers' own tokenization of it with the images
            text = processor.apply_chat_template(messages, tokenize=False, **template)
            out = processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="pt", **template
            )
        except Exception as error:  # jinja2 template errors, a processor's checks
            raise ValueError(f"the processor's chat template rejected the messages: {error}") from None
        return text, _token_ids(out), _media(out, loaded)
    raise ValueError(
        f"a prompt with images is a string or a list of chat messages (dicts); got {type(prompt).__name__}"
    )


def _messages_with_images(messages: Sequence[dict], images: list) -> tuple[list[dict], list]:
    """The messages with each image part holding its image loaded (a part without one takes the next of
    ``images``), and the images in order; a ValueError when parts and images do not match."""
    taken, loaded, out = 0, [], []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("video", "audio"):
                raise ValueError(
                    f"message {m}'s part {p} is a {part['type']} part; the engine takes image and text parts"
                )
            if isinstance(part, dict) and part.get("type") == "image":
                source = part.get("image", part.get("url", part.get("path")))
                if source is None:
                    if taken == len(images):
                        raise ValueError(
                            f"message {m}'s part {p} is an image part with no image, and the "
                            f"request's {len(images)} images are all taken"
                        )
                    source, taken = images[taken], taken + 1
                image = load_image(source, f"message {m}'s image part {p}")
                loaded.append(image)
                part = {"type": "image", "image": image}
            parts.append(part)
        out.append({**message, "content": parts})
    if taken < len(images):
        raise ValueError(f"{len(images)} images were given but the messages' image parts take {taken}")
    return out, loaded


def _check_count(images: list) -> None:
    if len(images) > MAX_IMAGES:
        raise ValueError(f"a prompt takes at most {MAX_IMAGES} images; got {len(images)}")


def _token_ids(out) -> list[int]:
    ids = out["input_ids"]
    return [int(t) for t in (ids[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else ids)]


def _media(out, images: list) -> MediaInputs | None:
    """The processor's outputs besides the token ids and mask, and the images' hashes (None without images)."""
    if not images:
        return None
    digests = tuple(_image_digest(image) for image in images)
    inputs = {
        name: value
        for name, value in out.items()
        if name not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)
    }
    whole = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return MediaInputs(inputs, whole, digests)


def _image_digest(image) -> str:
    """An image's content hash: its size and its pixels."""
    digest = hashlib.sha256(f"{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def processed_media(inputs) -> MediaInputs:
    """The multimodal inputs a processor made for one prompt (``{"prompt_token_ids", "multimodal_inputs"}``
    prompts), checked: a dict of tensors, the images' (not the per-token types') content hashed."""
    if (
        not isinstance(inputs, dict)
        or not inputs
        or not all(isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in inputs.items())
    ):
        raise ValueError("multimodal_inputs is a dict of the processor's tensors for the prompt (pixel_values, ...)")
    digest = hashlib.sha256()
    for name, value in sorted(inputs.items()):
        if per_token(name):  # the prompt's token types: its token ids say them
            continue
        digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return MediaInputs(dict(inputs), digest.hexdigest())
