"""Every docstring Example in functransforms.linalg runs (they are doctests)."""

import doctest
import importlib
import pkgutil

import functransforms.linalg
import pytest

MODULES = sorted(
    m.name for m in pkgutil.iter_modules(functransforms.linalg.__path__, "functransforms.linalg.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_every_public_callable_has_an_example():
    missing = [
        name
        for name in functransforms.linalg.__all__
        if "Example" not in (getattr(functransforms.linalg, name).__doc__ or "")
    ]
    assert missing == [], missing
