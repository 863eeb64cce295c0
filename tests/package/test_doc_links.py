"""Every relative link of README.md and of the pages under docs/ (any depth) resolves: the file
exists, and a ``#anchor`` names a heading of the target page (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

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
