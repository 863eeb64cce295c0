from pathlib import Path

from functransforms.coverage import render


def test_coverage_doc_is_current():
    path = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
    assert path.read_text() == render(), (
        "docs/coverage.md is stale: run python -m functransforms.coverage"
    )
