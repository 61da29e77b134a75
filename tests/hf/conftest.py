"""Fixtures of the slabstage.hf tests."""

import pytest


@pytest.fixture(scope="module")
def models():
    """``models(family)``: that family's tiny random model, made once per test module."""
    from slabstage.hf.tiny import tiny_model

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny_model(family)
        return cache[family]

    return get
