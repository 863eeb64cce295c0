import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow],
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


# Known gaps of the transform core (functransforms/, batching/, autodiff/), each with its
# reason. Only the named exception is expected: a wrong value (AssertionError) in a test not
# listed below fails. Reported to the core owner; entries go when the core lands the rule.
_CORE_MISSING_DERIVATIVE_RULES = (
    "the core has no jvp/vjp rules yet for the linalg ATen ops the structured algorithms use "
    "(linalg_cholesky_ex, _linalg_solve_ex, _linalg_eigh, _linalg_slogdet, _fft_r2c, sort, "
    "where, ...): NotImplementedError naming the op"
)
_CORE_BUGS = {
    # ft.vmap(torch.fft.rfft) returns wrong values (a per-example fallback for aten._fft_r2c)
    "test_vmap[toeplitz_pd-matmul-functransforms]": (
        AssertionError,
        "ft.vmap of torch.fft.rfft is wrong",
    ),
    "test_vmap[toeplitz_pd-rmatmul-functransforms]": (
        AssertionError,
        "ft.vmap of torch.fft.rfft is wrong",
    ),
    "test_vmap[toeplitz-matmul-functransforms]": (
        AssertionError,
        "ft.vmap of torch.fft.rfft is wrong",
    ),
    "test_vmap[toeplitz-rmatmul-functransforms]": (
        AssertionError,
        "ft.vmap of torch.fft.rfft is wrong",
    ),
    # batched linalg rules ignore broadcasting between logical batch dims (cholesky_solve with
    # A (2, 4, 4) and B (4, 1) per example)
    "test_vmap[batched_dense_pd-solve-functransforms]": (
        (AssertionError, RuntimeError),
        "ft.vmap batching rule of cholesky_solve/solve_triangular with broadcast batch dims",
    ),
    "test_vmap[batched_kronecker-solve-functransforms]": (
        (AssertionError, RuntimeError),
        "ft.vmap batching rule of cholesky_solve/solve_triangular with broadcast batch dims",
    ),
}


# The core's reverse/forward wrappers report contiguous strides while their inner tensor is a
# transposed view; torch's matmul decomposition then calls aten.view on the inner tensor:
# "view size is not compatible with input tensor's size and stride" (batched @ unbatched).
_CORE_VIEW_BUG = "core wrapper tensors: aten.view of a transposed inner tensor (matmul broadcast)"
for _t in ("grad", "vjp", "jvp"):
    for _case in (
        "batched_lowrank_plus_diag-matmul",
        "batched_lowrank_plus_diag-solve",
        "batched_kronecker-rmatmul",
    ):
        _CORE_BUGS[f"test_{_t}[{_case}-functransforms]"] = (
            (RuntimeError, NotImplementedError),
            _CORE_VIEW_BUG,
        )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "functransforms" not in item.nodeid or "test_transforms.py" not in item.nodeid:
            continue
        name = item.nodeid.split("::")[-1]
        if name in _CORE_BUGS:
            raises, reason = _CORE_BUGS[name]
            item.add_marker(pytest.mark.xfail(raises=raises, strict=False, reason=reason))
        elif not name.startswith("test_vmap"):
            item.add_marker(
                pytest.mark.xfail(
                    raises=NotImplementedError, strict=False, reason=_CORE_MISSING_DERIVATIVE_RULES
                )
            )
