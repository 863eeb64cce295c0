import warnings

import pytest
import torch
from functransforms.batching import _tensor

from functransforms.errors import FallbackWarning


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def no_fallback(monkeypatch):
    """Any op that runs through vmap's per-example loop fails the test."""
    monkeypatch.setattr(_tensor, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield
