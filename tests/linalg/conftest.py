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
# reason, per test id. Only the named exception is expected: a wrong value (AssertionError) in
# a test not listed below fails. Entries go when the core fixes the gap.
_CORE_BUGS: dict = {}


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
            False,
        )

# The same wrapper-stride bug, reached through a LAPACK result: torch.linalg.inv of a batch
# returns column-major (transposed) strides, the wrapper reports row-major ones, and
# `inv(A) @ b` (batched matrix @ vector) views the inner tensor. Strict: they must go when the
# wrapper strides are fixed.
_CORE_VIEW_BUG_LAPACK = (
    "core wrapper tensors report contiguous strides for a column-major LAPACK result "
    "(linalg_inv_ex of a batch); matmul's aten.view on the inner tensor then raises"
)
for _t in ("grad", "vjp", "jvp"):
    for _case in (
        "batched_dense_pd-inv_matmul",
        "batched_kronecker-inv_matmul",
        "batched_lowrank_plus_diag-inv_matmul",
    ):
        _CORE_BUGS[f"test_{_t}[{_case}-functransforms]"] = (
            RuntimeError,
            _CORE_VIEW_BUG_LAPACK,
            True,
        )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "functransforms" not in item.nodeid or "test_transforms.py" not in item.nodeid:
            continue
        name = item.nodeid.split("::")[-1]
        if name in _CORE_BUGS:
            raises, reason, strict = _CORE_BUGS[name]
            item.add_marker(pytest.mark.xfail(raises=raises, strict=strict, reason=reason))
