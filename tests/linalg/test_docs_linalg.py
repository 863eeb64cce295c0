"""docs/linalg.md runs: its ```python blocks are executed in order, in one namespace."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "linalg.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_the_tour_and_the_gp_example():
    text = DOC.read_text()
    assert "## A tour of the operators" in text and "Gaussian-process regression" in text
    assert len(_blocks()) >= 6


def test_docs_linalg_python_blocks_run():
    """Every block runs, including the Gaussian-process gradient with ft.grad (a missing
    derivative rule fails here)."""
    ns: dict = {"__name__": "docs_linalg"}
    for i, block in enumerate(_blocks()):
        exec(compile(block, f"{DOC.name}[block {i}]", "exec"), ns)
    assert (
        ns["g"].shape == (4,) and ns["marginal_log_likelihood"](ns["params"], ns["y"]) > ns["mll"]
    )
