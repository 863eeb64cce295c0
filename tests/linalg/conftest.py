import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _float64_and_quiet():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield
    torch.set_default_dtype(old)
