"""Shared test setup: hypothesis profiles, seeds, and the ``device`` fixture.

The default dtype stays float32 (as for users); tests ask for float64 explicitly.
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.fixture(params=_DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
