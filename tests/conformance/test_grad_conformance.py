"""ft.vjp / ft.jvp on every differentiable OpInfo of op_db against torch.func.vjp / jvp.

Note [Conformance suite] (conformance_harness.py) describes the cases and the outcomes.
"""

import pytest
from conformance_harness import params, run_case
from expected_failures import EXPECTED

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("name,kind,expected", params("vjp", EXPECTED))
def test_vjp(name, kind, expected):
    run_case("vjp", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("jvp", EXPECTED))
def test_jvp(name, kind, expected):
    run_case("jvp", name, kind, expected)
