"""docs/api.md is the API reference that tests/package/api_reference.py generates: every public name
with its signature and docstring summary. Stale (a name added, renamed, re-documented) fails."""

from __future__ import annotations

import importlib

import api_reference


def test_api_page_is_current():
    assert api_reference.PAGE.read_text() == api_reference.render(), (
        "docs/api.md is stale: run `python tests/package/api_reference.py` and commit the page"
    )


def test_api_page_lists_every_public_name():
    # guards the test above: render() covers every __all__ it promises, with a summary each
    page = api_reference.render()
    for modname, _ in api_reference.MODULES:
        module = importlib.import_module(modname)
        for name in module.__all__:
            assert f"### `{modname}.{name}`" in page, f"{modname}.{name} missing"
    for name in ("vmap", "grad", "jacrev", "linearize", "jit"):
        assert f"\n{name}(func" in page or f"\n{name}(f" in page, name
