"""Isolation of the conformance tests: each one restores torch's global state."""

import warnings

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "conformance: OpInfo conformance against torch.func (tests/conformance)"
    )


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    grad = torch.is_grad_enabled()
    rng = torch.get_rng_state()
    filters = list(warnings.filters)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)
        warnings.filters[:] = filters
