"""The style guide's checkable parts: the public API is typed and ships py.typed, every package
on disk is installed, and hypothesis is configured in one place."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import pytest

import functransforms

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _public_functions():
    for name in functransforms.__all__:
        obj = getattr(functransforms, name)
        if inspect.isfunction(obj):
            yield name, obj


def test_public_api_has_type_hints():
    missing = []
    for name, f in _public_functions():
        hints = typing.get_type_hints(f)  # also fails on an annotation that does not resolve
        params = [p for p in inspect.signature(f).parameters if p not in hints]
        if params or "return" not in hints:
            missing.append(f"{name}: {params + ([] if 'return' in hints else ['return'])}")
    assert not missing, f"public functions without type hints: {missing}"
    assert len(dict(_public_functions())) >= 20


def test_py_typed_is_shipped():
    assert (ROOT / "functransforms" / "py.typed").exists()
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["functransforms"]


def test_every_package_is_installed():
    """A subpackage missing from pyproject works in a checkout and is absent from a wheel."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join((package, *init.parent.relative_to(ROOT / folder).parts))
        for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert on_disk <= listed, f"not in pyproject's [tool.setuptools] packages: {on_disk - listed}"


def test_hypothesis_profiles_are_registered_once():
    """tests/conftest.py registers and loads the profiles; nothing else overrides them (the number
    of examples would then depend on which folders are collected)."""
    pattern = re.compile(r"register_profile|load_profile|max_examples\s*=")
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("*.py")
        if p != ROOT / "tests" / "conftest.py"
        and p != Path(__file__).resolve()
        and pattern.search(p.read_text())
    ]
    assert not offenders, f"hypothesis settings outside tests/conftest.py: {offenders}"
