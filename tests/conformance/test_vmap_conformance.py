"""ft.vmap on every OpInfo of op_db against a Python loop and torch.func.vmap.

Note [Conformance suite] (conformance_harness.py) describes the cases and the outcomes.
"""

import pytest
from conformance_harness import params, run_case
from expected_failures import EXPECTED

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("name,kind,expected", params("vmap", EXPECTED))
def test_vmap(name, kind, expected):
    run_case("vmap", name, kind, expected)
