"""docs/coverage.md (torch 2.13) and docs/coverage-torch<minor>.md (other supported torch) are
generated; the page of the installed torch must be current."""

import pytest

from functransforms._compat import TORCH_MINOR
from functransforms.coverage import doc_path, render


def test_coverage_doc_is_current():
    path = doc_path()
    if not path.exists():
        pytest.fail(
            f"no coverage page for torch {TORCH_MINOR}: run python -m functransforms.coverage"
        )
    assert path.read_text() == render(), (
        f"{path.name} is stale for torch {TORCH_MINOR}: run python -m functransforms.coverage"
    )
