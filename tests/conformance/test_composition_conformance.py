"""Composed transforms on every OpInfo against torch.func's same composition: ft.vmap(ft.vjp),
ft.jvp(ft.vjp), ft.vmap(ft.jvp), ft.vjp(ft.vjp); and ft.vmap with other in_dims / out_dims than
0 and nested (vmap_dims) against the per-example loop and torch.func.vmap.

Note [Conformance compositions] (conformance_compositions.py) describes the cases; vmap_dims:
Note [Conformance of in_dims, out_dims and nested vmap] (conformance_vmap_dims.py).
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


@pytest.mark.parametrize("name,kind,expected", params("vmap(jvp)", EXPECTED))
def test_vmap_jvp(name, kind, expected):
    run_case("vmap(jvp)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("vjp(vjp)", EXPECTED))
def test_vjp_vjp(name, kind, expected):
    run_case("vjp(vjp)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("vjp(jvp)", EXPECTED))
def test_vjp_jvp(name, kind, expected):
    run_case("vjp(jvp)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("vmap_dims", EXPECTED))
def test_vmap_dims(name, kind, expected):
    run_case("vmap_dims", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("autograd(vjp)", EXPECTED))
def test_autograd_vjp(name, kind, expected):
    run_case("autograd(vjp)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("autograd(vmap)", EXPECTED))
def test_autograd_vmap(name, kind, expected):
    run_case("autograd(vmap)", name, kind, expected)


@pytest.mark.parametrize("name,kind,expected", params("autograd(jvp)", EXPECTED))
def test_autograd_jvp(name, kind, expected):
    run_case("autograd(jvp)", name, kind, expected)
