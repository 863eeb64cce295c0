"""What a fresh clone and its install give a user: the README's install (a strict editable
install: a tree of links holding only ``functransforms``) imports from any directory, the one
containing the clone included, without putting the clone's other folders on ``sys.path``; the
metadata declares the license it ships; the sdist carries the tests, docs and benchmarks."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _link_tree(dest):
    """What ``pip install -e . --config-settings editable_mode=strict`` builds (setuptools'
    link tree, under build/ of the clone, put on sys.path by a .pth): functransforms/ whose files
    link to the clone's, with the mapped subpackages (pyproject's package-dir) inside it."""
    pkg = dest / "functransforms"
    pkg.mkdir(parents=True)
    for f in (ROOT / "functransforms").iterdir():
        if f.name != "__pycache__":
            (pkg / f.name).symlink_to(f, target_is_directory=f.is_dir())
    for sub, src in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        if sub != "functransforms":
            (pkg / sub.split(".")[1]).symlink_to(ROOT / src, target_is_directory=True)
    return dest


def _python(code, cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_the_install_imports_beside_the_clone_and_exposes_nothing_else(tmp_path):
    tree = _link_tree(tmp_path / "tree")
    beside = tmp_path / "work"
    beside.mkdir()
    (beside / "functransforms").symlink_to(ROOT, target_is_directory=True)  # `git clone` gives
    code = (
        "import importlib.util, torch, functransforms as ft\n"
        "print(ft.vmap(torch.sin)(torch.zeros(2, 1)).shape, ft.linalg.__name__)\n"
        "print([n for n in ('tests', 'benchmarks', 'linalg', 'autodiff', 'batching')\n"
        "       if importlib.util.find_spec(n) is not None])"
    )
    for cwd in (beside, tmp_path):
        r = _python(code, cwd, pythonpath=tree)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:2] == ["torch.Size([2, 1]) functransforms.linalg", "[]"]


def test_a_subpackage_imported_by_its_own_name_says_so():
    # started in the repository root, `import linalg` finds the folder: not a clone shadowing
    for sub in ("linalg", "autodiff", "batching"):
        r = _python(f"import {sub}", ROOT)
        assert r.returncode != 0
        assert f"import functransforms.{sub}" in r.stderr and "shadows" not in r.stderr


def test_license_is_declared_and_shipped():
    project = PYPROJECT["project"]
    assert project["license"] == "BSD-3-Clause"  # PEP 639's SPDX expression
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the functransforms authors" in text
    assert any("Typing :: Typed" in c for c in project["classifiers"])


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_required_dependencies_are_the_ones_the_library_imports():
    required = {
        re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower()
        for d in PYPROJECT["project"]["dependencies"]
    }
    sources = [
        p
        for src in PYPROJECT["tool"]["setuptools"]["package-dir"].values()
        for p in (ROOT / src).rglob("*.py")
    ]
    imported = set().union(*(_imports(p) for p in sources))
    assert required == {"torch", "optree"}
    assert required <= imported
    assert "numpy" not in imported  # numpy is a test extra only


def _tracked_files():
    r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return set(r.stdout.split())


# tracked files that are the repository's, not the source distribution's
_REPOSITORY_ONLY = {".ci/run", ".gitignore"}


def test_the_sdist_carries_every_tracked_file(tmp_path):
    """The sdist, built by setuptools from the tracked files, holds each of them (tests with
    their conftest.py files and subfolders, docs, benchmarks, LICENSE, CHANGELOG.md, the
    CONTRIBUTING.md that README links) and nothing else but its own metadata."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("pyproject.toml's SPDX license needs setuptools >= 77 (its build-system)")
    import shutil
    import tarfile

    tracked = _tracked_files()
    src = tmp_path / "src"
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    build = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    r = _python(build, src)
    assert r.returncode == 0, r.stderr[-3000:]
    with tarfile.open(src / "dist" / r.stdout.split()[-1]) as sdist:
        names = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()}
    metadata = {n for n in names if n in ("PKG-INFO", "setup.cfg") or ".egg-info/" in n}
    assert names - metadata == tracked - _REPOSITORY_ONLY
    assert {"LICENSE", "tests/conftest.py", "tests/batching/conftest.py", "docs/api.md"} <= names
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_one_install_command_everywhere():
    """README's install command is the one CONTRIBUTING.md and CI run: a strict editable install
    (the tests above build what it builds)."""
    command = "pip install -e '.[test]' --config-settings editable_mode=strict"
    for name in ("README.md", "CONTRIBUTING.md", ".ci/run"):
        if name == ".ci/run" and not (ROOT / name).exists():
            continue  # an unpacked sdist: the repository's CI is not part of it
        text = (ROOT / name).read_text()
        installs = re.findall(r"pip install (?:-q )?-e '?\.[^&\n#]*", text)
        assert installs, f"{name}: no editable install"
        for found in installs:
            assert found.replace("-q ", "").strip() == command, f"{name}: {found!r}"
