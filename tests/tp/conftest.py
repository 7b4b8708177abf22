"""Fixtures of the tensor-parallel tests."""

import pytest

from tests.models import tiny_model


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama saved to a folder, for the ranks to load with ``tp_plan="auto"``."""
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(path)
    return path
