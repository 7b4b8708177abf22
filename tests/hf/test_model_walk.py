"""Every causal-LM model type of the installed transformers (``tests/hf/model_walk.py``): served by hfaccel's loop
with transformers' tokens, or left on transformers' path with a reason — never accepted and then broken; and no type
that was served (``model_walk_served.json``, per transformers release) stops being served."""

import json
import warnings
from pathlib import Path

import transformers
from packaging.version import Version

from tests.hf.model_walk import BROKEN, DECLINED, NO_TINY_MODEL, SERVED, model_types, models_page, walk_one

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
        assert MODELS_PAGE.read_text() == models_page(outcomes), "docs/models.md: run python -m tests.hf.model_walk"
