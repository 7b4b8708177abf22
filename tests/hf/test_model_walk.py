"""Every causal-LM model type of the installed transformers (``tests/hf/model_walk.py``): served by hfaccel's loop
with transformers' tokens, or left on transformers' path with a reason — never accepted and then broken; and no type
that was served (``model_walk_served.json``, per transformers release) stops being served."""

import json
import warnings
from pathlib import Path

import transformers
from packaging.version import Version
from transformers import AutoModelForImageTextToText

from tests.hf.model_walk import (
    BROKEN,
    DECLINED,
    NO_TINY_MODEL,
    SERVED,
    image_text_section,
    image_text_types,
    model_types,
    models_page,
    walk_one,
)

SERVED_LISTS = Path(__file__).with_name("model_walk_served.json")
MODELS_PAGE = Path(__file__).parents[2] / "docs" / "models.md"


class WalkSummary(UserWarning):
    """The walk's counts, shown in the test run's warnings summary."""


def expected_served() -> set[str]:
    """The types served on the installed transformers' release, or on the newest release listed before it."""
    lists = json.loads(SERVED_LISTS.read_text())
    installed = Version(transformers.__version__)
    known = [v for v in lists if Version(v) <= installed]
    return set(lists[max(known, key=Version)]) if known else set()


def test_every_causal_lm_type_is_served_exactly_or_declined():
    outcomes = [walk_one(model_type) for model_type in model_types()]
    by_status = {
        status: [o for o in outcomes if o.status == status] for status in (SERVED, DECLINED, NO_TINY_MODEL, BROKEN)
    }
    warnings.warn(
        WalkSummary(
            f"transformers {transformers.__version__}: {len(by_status[SERVED])} of {len(outcomes)} "
            f"causal-LM types served by hfaccel, {len(by_status[DECLINED])} declined with a reason, "
            f"{len(by_status[NO_TINY_MODEL])} not runnable by transformers as tiny models"
        )
    )
    assert not by_status[BROKEN], "\n".join(f"{o.model_type}: {o.detail}" for o in by_status[BROKEN])
    served = {o.model_type for o in by_status[SERVED]}
    lost = sorted((expected_served() & set(model_types())) - served)
    assert not lost, "no longer served: " + "; ".join(
        f"{o.model_type}: {o.status}, {o.detail}" for o in outcomes if o.model_type in lost
    )
    if f"transformers {transformers.__version__} " in MODELS_PAGE.read_text():  # the release the page was made on
        assert MODELS_PAGE.read_text().startswith(models_page(outcomes) + "\n# "), (
            "docs/models.md: run python -m tests.hf.model_walk"
        )


# the vision-language families whose image prompts tests/hf/test_multimodal.py checks (those the release has)
SERVED_WITH_IMAGES = {"gemma3", "idefics3", "llava", "mistral3", "qwen2_5_vl", "qwen3_5", "qwen3_vl", "smolvlm"}


def test_every_image_text_type_is_served_exactly_or_declined_on_text_prompts():
    """Every image-text-to-text type of the installed transformers, prompted with text alone: served by hfaccel's loop
    with transformers' tokens or left on transformers' path with a reason, never accepted and then broken; none of
    the families checked with images is among the declined."""
    outcomes = [walk_one(model_type, AutoModelForImageTextToText) for model_type in image_text_types()]
    broken = [o for o in outcomes if o.status == BROKEN]
    assert not broken, "\n".join(f"{o.model_type}: {o.detail}" for o in broken)
    declined = {o.model_type: o.detail for o in outcomes if o.status == DECLINED}
    assert not SERVED_WITH_IMAGES & set(declined), {t: declined[t] for t in SERVED_WITH_IMAGES & set(declined)}
    if f"transformers {transformers.__version__} " in MODELS_PAGE.read_text():  # the release the page was made on
        assert MODELS_PAGE.read_text().endswith("\n" + image_text_section(outcomes)), (
            "docs/models.md: run python -m tests.hf.model_walk"
        )
    served = sum(o.status == SERVED for o in outcomes)
    warnings.warn(
        WalkSummary(
            f"transformers {transformers.__version__}: {served} of {len(outcomes)} image-text types served by "
            f"hfaccel on text prompts, {len(declined)} declined with a reason"
        )
    )
