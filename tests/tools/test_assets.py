"""Tests that need the offline assets skip where they are absent (a GPU machine has no network), saying how to
get them; tests never download."""

import pytest

from tests.assets import shakespeare_or_skip, smollm2_or_skip


@pytest.mark.parametrize("needs", [smollm2_or_skip, lambda: shakespeare_or_skip("hamlet")])
def test_a_missing_asset_skips_naming_what_to_do(monkeypatch, tmp_path, needs):
    monkeypatch.setenv("HFACCEL_CACHE", str(tmp_path))
    with pytest.raises(pytest.skip.Exception, match=r"`make assets`.*or set HFACCEL_CACHE to a folder that holds it"):
        needs()
