"""Every model type transformers registers for causal LM, tried as a new user would: a tiny random-weight model,
transformers' greedy ``generate`` on a left-padded batch, then the same after ``hfaccel.accelerate`` — hfaccel's
decode loop on its torch kernels (on a CPU ``attention="auto"`` hands every call to transformers' loop as the
faster path), and for a served type beam search too (transformers' loop over the cache hfaccel gives it). Each type
ends one of four ways (:class:`Outcome`): served by hfaccel's loop with transformers' tokens, left on transformers'
path with hfaccel's reason (and transformers' tokens), transformers itself unable to build or run the tiny model (its
error), or broken — accepted then failing, or other tokens — which must never be.

The image-text-to-text types are walked the same way (``AutoModelForImageTextToText``) on text prompts: the
language model's path; their image prompts are checked family by family in ``tests/hf/test_multimodal.py``.

``python -m tests.hf.model_walk`` walks every type and writes ``docs/models.md`` from the outcomes.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

import hfaccel
from hfaccel.runner.step_function import failure_reason
from tests.hf.tiny_configs import SPECIAL_BASE, tiny_config

SERVED, DECLINED, NO_TINY_MODEL, BROKEN = "served", "declined", "transformers cannot run a tiny model", "broken"
LENGTHS = (5, 3, 7)  # the prompts of the left-padded batch
MAX_NEW_TOKENS = 6
# models that need a call after they are built before they can run
POST_BUILD = {"xmod": lambda model: model.set_default_language("en_XX")}


@dataclass(frozen=True)
class Outcome:
    model_type: str
    status: str  # SERVED, DECLINED, NO_TINY_MODEL or BROKEN
    detail: str  # how hfaccel serves it, its reason, transformers' error, or what broke
    seconds: float


def model_types() -> list[str]:
    """The causal-LM model types of the installed transformers."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_types() -> list[str]:
    """The image-text-to-text model types of the installed transformers (walked on text prompts)."""
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def walk_one(model_type: str, auto=AutoModelForCausalLM) -> Outcome:
    """One type's outcome, its model built by ``auto`` (``AutoModelForImageTextToText``: a vision-language model,
    prompted with text alone)."""
    start = time.perf_counter()
    status, detail = _walk(model_type, auto)
    return Outcome(model_type, status, detail, time.perf_counter() - start)


def _walk(model_type: str, auto) -> tuple[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = _build(model_type, auto)
            ids, mask = _batch()
            expected = _generate(model, ids, mask)
        except Exception as error:
            return NO_TINY_MODEL, failure_reason(error)
        original, model = model, copy.deepcopy(model)
        try:
            hfaccel.accelerate(model, attention="torch", compile=False)
        except Exception as error:
            return BROKEN, f"accelerate raised {failure_reason(error)}"
        try:
            tokens = _generate(model, ids, mask)
        except Exception as error:
            return BROKEN, f"accepted, then generate() raised {failure_reason(error)}"
        info = model.hfaccel
        if not torch.equal(tokens, expected):
            return BROKEN, f"other tokens than transformers' ({info.decode})"
        if not info.active:
            return DECLINED, info.fallback_reason
        if info.decode.path != "hfaccel":
            return BROKEN, f"accepted, but transformers' loop served generate() ({info.decode})"
        broken = _beam_search_breaks(original, model, ids, mask)
    if broken is not None:
        return BROKEN, broken
    return SERVED, hfaccel.runner.support.model_support(model).layout.describe()


def _beam_search_breaks(original, model, ids: torch.Tensor, mask: torch.Tensor) -> str | None:
    """How beam search — transformers' loop, over the cache hfaccel gives it and hfaccel's attention — breaks on the
    accelerated ``model`` where it runs on the ``original``; None where it gives transformers' tokens."""
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
    try:
        expected = original.generate(**kwargs)
    except Exception:  # transformers' own beam search does not run the model
        return None
    try:
        tokens = model.generate(**kwargs)
    except Exception as error:
        return f"accepted, then beam search (transformers' loop) raised {failure_reason(error)}"
    return None if torch.equal(tokens, expected) else "beam search (transformers' loop) gave other tokens"


def _build(model_type: str, auto):
    config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    except (ValueError, ImportError):  # a model transformers runs in eager attention only
        torch.manual_seed(0)
        model = auto.from_config(config)
    POST_BUILD.get(model_type, lambda m: None)(model)
    return model.eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of prompts of :data:`LENGTHS` tokens (ids below the special ones)."""
    generator = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n :] = torch.randint(3, SPECIAL_BASE, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def _generate(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0
    )


def models_page(outcomes: list[Outcome]) -> str:
    """docs/models.md's causal-LM part: every type with its outcome, grouped (the image-text part follows it:
    :func:`image_text_section`)."""
    lines = [
        "# Models",
        "",
        f"Every model type transformers {transformers.__version__} registers for causal LM "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), tried on a tiny random-weight model: `hfaccel.accelerate` "
        "then greedy `generate` on a left-padded batch, against transformers' own `generate` "
        "(`tests/hf/model_walk.py`; `python -m tests.hf.model_walk` writes this page, "
        "`tests/hf/test_model_walk.py` checks it on both CI environments). The image-text-to-text types follow.",
        "",
    ]
    return "\n".join(lines + _grouped(outcomes, "##"))


def image_text_section(outcomes: list[Outcome]) -> str:
    """docs/models.md's image-text part: every image-text-to-text type with its outcome on text prompts, grouped."""
    lines = [
        "# Image-text-to-text models, on text prompts",
        "",
        f"Every model type transformers {transformers.__version__} registers for image-text-to-text "
        "(`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), walked the same way on text prompts: what serves the "
        "language model. Prompts with images are checked family by family (`tests/hf/test_multimodal.py`; "
        "`docs/usage.md` lists the families).",
        "",
    ]
    return "\n".join(lines + _grouped(outcomes, "##"))


def _grouped(outcomes: list[Outcome], heading: str) -> list[str]:
    lines = []
    for status, title in (
        (SERVED, "Served by hfaccel (transformers' tokens)"),
        (DECLINED, "Left on transformers' path, with hfaccel's reason"),
        (NO_TINY_MODEL, "Transformers itself cannot run a tiny model of these"),
        (BROKEN, "Broken (must be empty)"),
    ):
        chosen = [o for o in outcomes if o.status == status]
        lines += [f"{heading} {title}: {len(chosen)}", "", "| model type | |", "| --- | --- |"]
        lines += [f"| `{o.model_type}` | {o.detail.replace('|', '/')} |" for o in chosen]
        lines.append("")
    return lines


def main() -> None:
    walks = {}
    for auto, types in ((AutoModelForCausalLM, model_types()), (AutoModelForImageTextToText, image_text_types())):
        outcomes = walks[auto] = []
        for model_type in types:
            outcomes.append(walk_one(model_type, auto))
            print(f"{outcomes[-1].status:>10}  {model_type}: {outcomes[-1].detail} ({outcomes[-1].seconds:.1f} s)")
    page = models_page(walks[AutoModelForCausalLM]) + "\n" + image_text_section(walks[AutoModelForImageTextToText])
    Path(__file__).parents[2].joinpath("docs", "models.md").write_text(page)
    every = [o for outcomes in walks.values() for o in outcomes]
    counts = {s: sum(o.status == s for o in every) for s in (SERVED, DECLINED, NO_TINY_MODEL, BROKEN)}
    print(counts)
    sys.exit(1 if counts[BROKEN] else 0)


if __name__ == "__main__":
    main()
