"""docs/linalg.md runs: its ```python blocks are executed in order, in one namespace."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "linalg.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_the_tour_and_the_gp_example():
    text = DOC.read_text()
    assert "## A tour of the operators" in text and "Gaussian-process regression" in text
    assert len(_blocks()) >= 6


def test_docs_linalg_python_blocks_run():
    ns: dict = {"__name__": "docs_linalg"}
    for i, block in enumerate(_blocks()):
        try:
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), ns)
        except NotImplementedError as e:
            if "there is no" in str(e) and "rule for aten." in str(e):
                # The transform core lacks a derivative/batching rule for an ATen op used by the
                # structured algorithm; reported, with the op, until the core registers it.
                pytest.xfail(f"block {i}: transform core missing a rule: {str(e).splitlines()[0]}")
            raise
