"""Every relative link of README.md, CONTRIBUTING.md and the pages under docs/ (any depth)
resolves: the file exists, and a ``#anchor`` names a heading of the target page (GitHub's heading
ids). The design pages, README and CONTRIBUTING name source files that exist, every
``Note [...]`` cited anywhere is written somewhere, and CONTRIBUTING gives README's commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]

_CODE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)  # fenced blocks hold no links
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", flags=re.M)


def _prose(page):
    return _CODE.sub("", page.read_text())


def _slug(heading):
    """GitHub's id of a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page):
    seen, ids = {}, set()
    for heading in _HEADING.findall(_prose(page)):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def links(page):
    """The relative targets of ``page``'s links (not URLs, not mail)."""
    text = _INLINE_CODE.sub("", _prose(page))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with id #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_checker_sees_links_and_anchors():
    # guards the test above against passing because it finds nothing
    readme = links(ROOT / "README.md")
    assert "docs/design/README.md" in readme
    assert "source-layout" in anchors(ROOT / "docs" / "design" / "rules.md")
    assert _slug("11. `argwhere` under `vmap` raises like `nonzero`") == (
        "11-argwhere-under-vmap-raises-like-nonzero"
    )


# -- source files named by the pages that explain the code ---------------------------------------

_EXPLAINING = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs" / "design").glob("*.md")),
]
_PY_NAME = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*([\w-]+)\.py)\b")
_SKIPPED_DIRS = {"build", "dist", "__pycache__"}


def _sources(suffixes):
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.suffix in suffixes and not any(
            p in _SKIPPED_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in parts[:-1]
        ):
            yield path


def missing_paths(text, files):
    """The ``*.py`` names of ``text`` that name no file: a path with a folder must end a path
    from the repository root (``_core/levels.py`` inside ``functransforms/``), a bare file name
    must be somewhere in it. ``F.py`` (one capital) is a placeholder for a family name."""
    rel = {f.relative_to(ROOT).as_posix() for f in files}
    names = {f.name for f in files}
    missing = []
    for m in _PY_NAME.finditer(text):
        path, stem = m.groups()
        if re.fullmatch(r"[A-Z]", stem):
            continue
        if "/" in path:
            found = path in rel or any(r.endswith("/" + path) for r in rel)
        else:
            found = path in names
        if not found:
            missing.append(path)
    return missing


@pytest.mark.parametrize("page", _EXPLAINING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_source_files_named_by_the_page_exist(page):
    missing = missing_paths(page.read_text(), list(_sources({".py"})))
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


# -- Note [...] citations --------------------------------------------------------------------------

# A note is written where a line (a comment, a docstring's first line) starts with its name; a
# citation may wrap over comment lines or adjacent string literals. "Note [Title ...]" abbreviates.
_NOTE_WRITTEN = re.compile(r"^\s*(?:#\s*|\"\"\"\s*)?Note \[([^\]]+)\]", re.M)
_NOTE_CITED = re.compile(r"Note\s*\[([^\]]+)\]")
_WRAP = re.compile(r"\"?\s*\n\s*(?:#\s*|\")?")


def written_notes(texts):
    return {" ".join(m.group(1).split()) for t in texts for m in _NOTE_WRITTEN.finditer(t)}


def unknown_citations(text, written):
    cited = (" ".join(m.group(1).split()) for m in _NOTE_CITED.finditer(_WRAP.sub(" ", text)))
    return sorted({c for c in cited if not c.endswith("...") and c != "Title" and c not in written})


def test_every_cited_note_is_written_somewhere():
    py = list(_sources({".py"}))
    written = written_notes(p.read_text() for p in py)
    assert len(written) > 100
    unknown = {}
    for path in [*py, *_sources({".md"})]:
        if path == Path(__file__).resolve():  # its guard below cites unknown notes on purpose
            continue
        found = unknown_citations(path.read_text(), written)
        if found:
            unknown[path.relative_to(ROOT).as_posix()] = found
    assert not unknown, f"Note [...] citations that no file writes: {unknown}"


def test_the_reference_checkers_find_stale_names():
    # guards the two tests above against passing because they match nothing
    files = list(_sources({".py"}))
    assert missing_paths("graph rewrites in `functransforms/_jit_passes.py`", files) == [
        "functransforms/_jit_passes.py"
    ]
    assert missing_paths(
        "`_jit_guards.py`, `functransforms/_jit/_guards.py`, `_passes.py`", files
    ) == ["_jit_guards.py"]
    written = written_notes(["x = 1\n# Note [Grad mode]\n#     body\n"])
    assert written == {"Grad mode"}
    text = "# (Note [Grad\n# mode]) and Note [Clamp with Tensor bounds]; Note [Grad ...]\n"
    assert unknown_citations(text, written) == ["Clamp with Tensor bounds"]


def test_contributing_gives_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^    ((?:pip install|python -m pytest) .*)$", readme, flags=re.M)
    assert len(commands) == 2, commands
    contributing = (ROOT / "CONTRIBUTING.md").read_text().splitlines()
    missing = [c for c in commands if "    " + c not in contributing]
    assert not missing, f"CONTRIBUTING.md does not give README's commands: {missing}"
