"""The style guide's checkable parts: the public API is typed and ships py.typed, every package
on disk is installed, hypothesis is configured in one place, and the repository names things by
subject, not by the history of their making."""

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


# What names history rather than a subject (CONTRIBUTING.md, "Code style": history lives in git
# and in issue notes): issue and session numbers, a helper agent named by its task ("lu
# helper"; a helper *function* is named by what it does: "family helper", "timing helper"),
# audit rounds, and narration of when ("this session", "at the end of the session"). English
# uses stay legal: "an interactive session (>>>)", "a long random session", "the leading dim".
HISTORY = re.compile(
    r"\bsessions?[\s-]+\d+"
    r"|\bissues?\s*#?\d+"
    r"|\b(?!(?:a|an|the|one|each|this|that|its|our|family|timing|shape|testing|test|module"
    r"|private|public|small|internal|pytree|rule|wrapper)\b)[a-z][a-z0-9]*\s+helper\b"
    r"(?!\s+(?:function|functions|method|methods|class|module)\b)"
    r"|\bhelpers?\s+(?:wrote|finished)\b"
    r"|\baudit\s+rounds?\b"
    r"|\bthis\s+session\b"
    r"|\bthe\s+lead(?:'s)?\b"
    r"|\bat\s+the\s+(?:last|end\s+of\s+the)\s+(?:stop|session)\b"
    r"|\bend\s+of\s+session\b",
    re.IGNORECASE,
)
_SKIPPED_DIRS = {"build", "dist", "__pycache__"}


def _history_lines(paths):
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                yield f"{path.relative_to(ROOT).as_posix()}:{n}: {m.group(0)!r}: {line.strip()}"


def _repository_files():
    """The .py, .md and .toml files of the repository and CI's script; not CHANGELOG.md (release
    notes), build outputs, hidden folders, nor this file (it spells the patterns out)."""
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if any(p in _SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        if any(p.startswith(".") for p in parts[:-1]) and parts[:-1] != (".ci",):
            continue
        if path.suffix in (".py", ".md", ".toml") or parts == (".ci", "run"):
            if path.name != "CHANGELOG.md" and path != Path(__file__).resolve():
                yield path


def test_no_history_in_names_docs_or_comments():
    files = list(_repository_files())
    assert len(files) > 100 and ROOT / "docs" / "performance.md" in files
    found = list(_history_lines(files))
    assert not found, (
        "history (issue or session numbers, helper agents, audit rounds) in the repository; "
        "say what the thing is or why, and leave when and by whom to git:\n" + "\n".join(found)
    )


# Words of a file, folder or function name that say when or by whom it was written: a session
# number (``_s9``, ``_s10b``), a probe, a session, an issue, the gaps of a round.
HISTORY_WORD = re.compile(r"(?:^|_)(?:s\d+[a-z]?|probes?|sessions?|issues?|gaps)(?=_|$)")


def history_in_names(paths):
    """The files, folders and test functions among ``paths`` whose names carry a history word
    (other functions may say probe in its English sense: ``stacks.probe`` makes probe tensors)."""
    found = []
    for path in paths:
        rel = path.relative_to(ROOT)
        found += [rel.as_posix() for part in rel.with_suffix("").parts if HISTORY_WORD.search(part)]
        if path.suffix == ".py":
            for name in re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", path.read_text(), re.M):
                if HISTORY_WORD.search(name):
                    found.append(f"{rel.as_posix()}::{name}")
    return sorted(set(found))


def test_no_history_in_file_or_function_names():
    files = [p for p in _repository_files() if p.suffix in (".py", ".md")]
    found = history_in_names(files)
    assert not found, f"names that say when, not what (name the subject): {found}"


@pytest.mark.parametrize(
    "name",
    [
        "tests/test_probe_programs_s8.py",
        "tests/test_probe_programs_s8b.py",
        "tests/test_gaps_s9.py",
        "tests/test_jit_probe_s9.py",
        "tests/test_fuzz_stacks_s10.py",
        "tests/test_x.py::test_issue_example_meta_gradient",
    ],
)
def test_the_name_scanner_finds_history(name):
    path, _, func = name.partition("::")
    assert HISTORY_WORD.search(Path(path).stem) or HISTORY_WORD.search(func), name


@pytest.mark.parametrize(
    "name",
    [
        "test_audit_vmap_of_grad_names_grad_and_the_forward_line",
        "test_view_round_trip_is_dropped",
        "test_helpers",
        "test_fuzz_stacks",
        "test_release_saved",
        "tests/interop/test_autograd_both_sides",
    ],
)
def test_the_name_scanner_leaves_subjects_alone(name):
    assert not HISTORY_WORD.search(name), name


@pytest.mark.parametrize(
    "line",
    [
        "# -- LU family (issue 8, lu helper) ---",
        "found by the session 9 probe: jvp of a frozen attention",
        "Found by the session-10 stack fuzzer",
        "the grad-only rows of issues 9/10 pay nothing",
        "targets (issue #13)",
        "## jit signature walk (jitsig helper; 2026-11-25)",
        "Sections other helpers wrote after the generated table",
        "none of this session's bugs",
        "after the second audit round",
        "the full run on a quieter machine is the lead's",
        "measured at the end of the session",
        "Quiet-machine run at the end of session 10",
    ],
)
def test_the_history_scanner_finds_history(line):
    # guards the test above against passing because its pattern matches nothing
    assert HISTORY.search(line), line


@pytest.mark.parametrize(
    "line",
    [
        'Blocks written as an interactive session (">>>") run as doctests',
        "``FT_FUZZ_EXAMPLES=5000`` runs a long, random session",
        "one line through a family helper (`def_unary`, `def_dims`, ...)",
        "from bench_core import median_time  # one timing helper for the suite",
        "the collectives, `pmap`, `rearrange` and the module helper functions load at first use",
        "its level there with the helper its `process` uses",
        "Test helpers: numerical derivative checks; Small shape helpers shared by the rules",
        "tx, ty = stacks.probe(x, 0.2), stacks.probe(y, 0.2)",
        "dims = list(range(lead)); the batch dim folds into the leading dim",
        "with ft.deterministic.audit() as report: every nondeterministic op",
        "the ops it issues; an issue note in git",
    ],
)
def test_the_history_scanner_leaves_english_alone(line):
    assert not HISTORY.search(line), HISTORY.search(line).group(0)
