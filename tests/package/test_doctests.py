"""Every docstring example in the core runs (Example sections are doctests), and so does every
```python block of README.md and of the pages under docs/, as in a plain install."""

import ast
import doctest
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest
import torch

import functransforms

PACKAGES = (
    "functransforms",
    "functransforms._core",
    "functransforms._jit",
    "functransforms.distributed",
    "functransforms.batching",
    "functransforms.autodiff",
    "functransforms.testing",
)
# Subpackages whose docstring examples run in their own subject's tests.
OWN_DOCTESTS = {
    "functransforms.linalg": "tests/linalg/test_doctests_linalg.py",
    "functransforms.deterministic": "tests/determinism/test_deterministic.py",
}


def _modules(pkg):
    # in a source checkout functransforms.__path__ also holds the repository root (for the
    # subpackages), where functransforms/ itself would be found again as a second copy
    return [
        m
        for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + ".")
        if not m.name.endswith(("__main__", ".functransforms"))
    ]


MODULES = sorted(m.name for pkg in PACKAGES for m in _modules(pkg))


def test_every_subpackage_runs_its_docstring_examples():
    subpackages = {m.name for pkg in PACKAGES for m in _modules(pkg) if m.ispkg}
    missing = subpackages - set(PACKAGES) - set(OWN_DOCTESTS)
    assert not missing, f"add to PACKAGES (their modules' examples run nowhere): {missing}"
    root = Path(__file__).resolve().parents[2]
    assert all((root / path).exists() for path in OWN_DOCTESTS.values())


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
        "functionalize",
        "stack_module_state",
    ):
        assert callable(getattr(functransforms, name))


# -- every ```python block of README.md and docs/ (any depth) ----------------------------------
# A page's blocks run in order in one namespace (a later block may use an earlier one's names).
# Blocks written as an interactive session (">>>") run as doctests, so their printed outputs are
# checked too. A block that cannot run (a signature, a fragment that needs the reader's own data)
# is fenced ```python no-run: <why>; docs/design/testing.md ("Documentation examples") says
# when to use it. The blocks must run in a plain install: none imports a test extra (pytest,
# hypothesis, ...).
ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", flags=re.S | re.M)
_NO_RUN = re.compile(r"no-run: \S.*")  # the reason is part of the fence


# What a page's examples must have computed, beyond running.
_AFTER = {
    # the Gaussian-process gradient with ft.grad (a missing derivative rule fails here)
    "linalg.md": lambda ns: (
        (ns["g"].shape == (4,) and ns["marginal_log_likelihood"](ns["params"], ns["y"]) > ns["mll"])
        or pytest.fail("docs/linalg.md: the GP example did not improve the marginal likelihood")
    ),
}


@pytest.fixture
def restore_torch_globals():
    """A page may set the thread count or the default dtype for its example."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


def _blocks(page):
    """(line, info, code) for each ```python block of ``page``."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
        for m in _FENCE.finditer(text)
    ]


@pytest.mark.parametrize(
    "page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_markdown_python_blocks_run(page, restore_torch_globals):
    namespace = {"__name__": page.stem.replace("-", "_")}
    parser, runner = (
        doctest.DocTestParser(),
        doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
    )
    for line, info, code in _blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if info.startswith("no-run"):
            assert _NO_RUN.fullmatch(info), f"{where}: write why it cannot run: 'no-run: <why>'"
            continue
        assert info == "", f"{where}: unknown fence info {info!r} (only 'no-run: <why>')"
        if code.lstrip().startswith(">>>"):
            test = parser.get_doctest(code, namespace, where, str(page), line)
            result = runner.run(test, clear_globs=False)
            assert result.failed == 0, f"{where}: {result.failed} example(s) failed"
            namespace.update(test.globs)  # DocTest ran on a copy of the namespace
        else:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102
    check = _AFTER.get(page.name)
    if check is not None:
        check(namespace)


def test_no_run_blocks_are_rare():
    """``no-run`` is for signatures and fragments only: most examples must run."""
    infos = [info for p in PAGES for _, info, _ in _blocks(p)]
    no_run = [info for info in infos if info.startswith("no-run")]
    assert len(no_run) <= max(3, len(infos) // 10), no_run


def _imported(code):
    """The top-level names a block imports (``import a.b`` -> ``a``)."""
    if code.lstrip().startswith(">>>"):
        code = "\n".join(e.source for e in doctest.DocTestParser().get_examples(code))
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


# What `pip install functransforms` brings: its required dependencies (pyproject.toml) and the
# standard library. numpy is not among them (torch does not require it either).
_PLAIN = {"functransforms", "torch", "optree", *sys.stdlib_module_names}


def _needs_an_extra(code):
    """The top-level modules a block imports beyond a plain install, except under an
    ``if importlib.util.find_spec(...)`` guard (an optional part of the example)."""
    if code.lstrip().startswith(">>>"):
        code = "\n".join(e.source for e in doctest.DocTestParser().get_examples(code))
    tree = ast.parse(code)
    guarded = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "find_spec" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    return {
        name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded
        for name in _imported(ast.unparse(node))
    } - _PLAIN


def test_markdown_blocks_run_in_a_plain_install():
    """A reader runs the examples after ``pip install functransforms``, without the test extras
    (pytest, hypothesis, ...) or numpy: no block imports one (write ``try``/``except`` with an
    assert on the message where a test would use ``pytest.raises``; guard an optional part with
    ``if importlib.util.find_spec(...)``)."""
    needing = [
        f"{p.relative_to(ROOT)}:{line} imports {sorted(_needs_an_extra(code))}"
        for p in PAGES
        for line, info, code in _blocks(p)
        if not info.startswith("no-run") and _needs_an_extra(code)
    ]
    assert not needing, needing
    assert _needs_an_extra("import pytest, torch.nn as nn, os\nfrom hypothesis import given") == {
        "pytest",
        "hypothesis",
    }
    assert _needs_an_extra("import numpy as np") == {"numpy"}
    guarded = "import importlib.util\nif importlib.util.find_spec('numpy'):\n    import numpy"
    assert _needs_an_extra(guarded) == set()
