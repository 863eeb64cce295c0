"""functransforms.testing itself: the checks catch wrong derivatives, the complex convention
matches torch.func, and importing the package does not import hypothesis."""

import subprocess
import sys

import pytest
import torch

import functransforms as ft
from functransforms.testing import check_grads, check_vmap


def test_import_does_not_need_hypothesis():
    code = (
        "import sys, functransforms, functransforms.testing; assert 'hypothesis' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_complex_vjp_convention_matches_torch_func():
    # PyTorch: vjp of a holomorphic f returns w * conj(f'(z)); the dot-product test in
    # check_grads uses Re<.,.>, whose adjoint is exactly that (Note [Complex dot-product test]).
    z = torch.randn(4, dtype=torch.complex128)
    w = torch.randn(4, dtype=torch.complex128)
    f = lambda z: z * z + 3 * z
    ours = ft.vjp(f, z)[1](w)[0]
    ref = torch.func.vjp(f, z)[1](w)[0]
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ref, w * (2 * z + 3).conj())
    check_grads(f, (z,))
    # and a real-to-complex map
    check_grads(lambda x: x.sin() * (1 + 2j) + x * x, (torch.randn(3, dtype=torch.float64),))


def test_torch_complex_under_jvp():
    check_grads(lambda x: torch.complex(x.sin(), x * x), (torch.randn(3, dtype=torch.float64),))


def test_check_grads_higher_order_and_mixed_args():
    a, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    idx = torch.tensor([2, 0])
    check_grads(lambda a, b, i: (a.sin() * b)[1:].exp() * i[0], (a, b, idx), order=3)
    check_grads(lambda a, b, i: (a.sin() * b)[i].exp(), (a, b, idx), order=1)


def test_second_order_through_advanced_indexing():
    a, idx = torch.randn(3, dtype=torch.float64), torch.tensor([2, 0])
    check_grads(lambda a: a.sin()[idx].exp(), (a,), order=2)


def test_check_grads_rejects_a_wrong_derivative():
    x = torch.randn(3, dtype=torch.float64)

    @ft.custom_vjp
    def wrong(x):
        return x.sin()

    def fwd(x):
        return x.sin(), x

    def bwd(x, g):
        return (g * 2 * x.cos(),)

    wrong.defvjp(fwd, bwd)
    with pytest.raises(AssertionError, match="dot-product test"):
        check_grads(wrong, (x,), modes=("rev",))


def test_check_grads_bad_arguments():
    with pytest.raises(ValueError, match="modes"):
        check_grads(torch.sin, (torch.zeros(1),), modes=("sideways",))
    with pytest.raises(ValueError, match="order"):
        check_grads(torch.sin, (torch.zeros(1),), order=0)


def test_check_vmap_none_negative_and_pytrees():
    x, w = torch.randn(4, 3), torch.randn(3)
    check_vmap(lambda x, w: {"a": x @ w, "b": (x * w, x.sum())}, (x, w), in_dims=(0, None))
    check_vmap(lambda x, w: x * w, (x.T, w), in_dims=(-1, None), out_dims=-1)
    check_vmap(
        lambda p: p["x"].sum() * p["w"],
        ({"x": x, "w": w[:, None].expand(3, 4)},),
        in_dims=({"x": 0, "w": 1},),
    )


def test_check_vmap_detects_a_difference():
    calls = []

    def f(x):  # under vmap it sees [3] per example via a wrapper; in the loop a plain tensor
        calls.append(type(x))
        return x * (2.0 if type(x) is torch.Tensor else 3.0)

    with pytest.raises(AssertionError, match="differs from the stacked loop"):
        check_vmap(f, (torch.randn(4, 3),))
