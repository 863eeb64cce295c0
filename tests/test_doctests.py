"""Every docstring example in the core runs (Example sections are doctests)."""

import doctest
import importlib
import pkgutil

import pytest

import functransforms

MODULES = sorted(
    m.name
    for pkg in ("functransforms", "functransforms.batching", "functransforms.autodiff")
    for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + ".")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_public_api_matches_torch_func_names():
    for name in (
        "vmap",
        "grad",
        "grad_and_value",
        "vjp",
        "jvp",
        "linearize",
        "jacrev",
        "jacfwd",
        "hessian",
        "functional_call",
        "stack_module_state",
    ):
        assert callable(getattr(functransforms, name))
