"""ft.vmap(ft.vjp) and ft.jvp(ft.vjp) on every differentiable OpInfo against torch.func's same
composition.

Note [Conformance compositions] (conformance_compositions.py) describes the cases.
"""

import pytest
from conformance_harness import params, run_case
from expected_failures import EXPECTED

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("name,kind,expected", params("vmap(vjp)", EXPECTED))
def test_vmap_vjp(name, kind, expected):
    run_case("vmap(vjp)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("jvp(vjp)", EXPECTED))
def test_jvp_vjp(name, kind, expected):
    run_case("jvp(vjp)", name, kind, expected)
