"""docs/linalg.md keeps its tour and GP example (tests/package/test_doctests.py runs its blocks)."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "linalg.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_the_tour_and_the_gp_example():
    text = DOC.read_text()
    assert "## A tour of the operators" in text and "Gaussian-process regression" in text
    assert len(_blocks()) >= 6
