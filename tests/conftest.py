"""Shared test setup: hypothesis profiles, seeds, and the ``device`` fixture.

The default dtype stays float32 (as for users); tests ask for float64 explicitly.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# The hypothesis profiles, registered here only, so a test draws the same number of examples
# whichever folders are collected. "ci" (the default) is derandomized: a failure reproduces on
# every run and machine. "explore" draws fresh, more numerous examples, to look for new failures
# (HYPOTHESIS_PROFILE=explore python -m pytest tests/...).
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, max_examples=30, **_COMMON)
settings.register_profile("explore", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# The stack fuzzer (tests/testing/test_fuzz_stacks.py) draws whole programs under transform stacks:
# a fixed derandomized budget for CI, or FT_FUZZ_EXAMPLES random ones for a long session.
_FUZZ = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("fuzz_ci", derandomize=True, max_examples=60, **_FUZZ)
settings.register_profile(
    "fuzz_long", max_examples=max(int(os.environ.get("FT_FUZZ_EXAMPLES") or 1), 1), **_FUZZ
)

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
