"""Scans (cumprod with zeros, logcumsumexp, cummax, cummin) against torch.func: jvp, vjp, grad,
second order, vmap of the vjp, and finite differences."""

import pytest
import torch
from _ad_helpers import compare_with_torch_func
from torch import func as tf

import functransforms as ft
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128


def _x(shape, dtype=F64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _with_zeros(x, where):
    x = x.clone()
    for idx in where:
        x[idx] = 0
    return x


CUMPROD_CASES = {
    "no zeros": [],
    "one zero": [(1, 2)],
    "two zeros in a row": [(0, 1), (0, 3)],
    "zero first": [(2, 0)],
    "zero last": [(1, 4)],
}


@pytest.mark.parametrize("case", sorted(CUMPROD_CASES))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumprod_with_zeros(case, dim):
    x = _with_zeros(_x((3, 5)), CUMPROD_CASES[case])
    compare_with_torch_func(lambda x: torch.cumprod(x, dim), (x,), order=1)
    t = _x((3, 5), seed=1)

    def loss(lib):
        return lambda x: (torch.cumprod(x, dim) ** 2).sum()

    torch.testing.assert_close(
        ft.jvp(ft.grad(loss(ft)), (x,), (t,))[1], tf.jvp(tf.grad(loss(tf)), (x,), (t,))[1]
    )


@pytest.mark.parametrize("dtype", [F64, C128])
def test_cumprod_complex_dtype_and_0d(dtype):
    x = _with_zeros(_x((4, 3), dtype), [(1, 1)])
    compare_with_torch_func(lambda x: torch.cumprod(x, 0), (x,), order=2)
    compare_with_torch_func(lambda x: torch.cumprod(x, 0), (_x((), dtype),), order=2)
    if dtype == F64:
        compare_with_torch_func(lambda x: torch.cumprod(x, 1, dtype=F64), (x.float(),), check=False)


@pytest.mark.parametrize("dtype", [F64, C128])
def test_logcumsumexp(dtype):
    compare_with_torch_func(lambda x: torch.logcumsumexp(x, 1), (_x((3, 6), dtype) * 3,), order=2)
    compare_with_torch_func(lambda x: torch.logcumsumexp(x, 0), (_x((), dtype),))


@pytest.mark.parametrize("dtype", [F64, C128])
def test_logcumsumexp_with_a_wide_spread(dtype):
    """Values 1e4 apart (Note [logcumsumexp derivatives]): a shift by the max underflowed to
    0 / 0 (NaN) before the 1e4; torch.func returns 0 there (and inf for complex). Ours agree
    with finite differences to second order, in x and in the cotangent (zeros included: the
    rule is linear in it)."""
    x = _x((3, 6), dtype) * 3
    x[1, 2] = 1e4
    ct, t, tc = _x((3, 6), dtype, seed=1), _x((3, 6), dtype, seed=2), _x((3, 6), dtype, seed=3)
    ct[0, :3] = 0

    def pullback(x, c):
        return ft.vjp(lambda x: torch.logcumsumexp(x, 1), x)[1](c)[0]

    eps = 1e-6
    fd = (pullback(x + eps * t, ct + eps * tc) - pullback(x - eps * t, ct - eps * tc)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(pullback, (x, ct), (t, tc))[1], fd, atol=1e-8, rtol=1e-7)
    fx = (torch.logcumsumexp(x + eps * t, 1) - torch.logcumsumexp(x - eps * t, 1)) / (2 * eps)
    out, jt = ft.jvp(lambda x: torch.logcumsumexp(x, 1), (x,), (t,))
    assert torch.isfinite(jt).all()
    torch.testing.assert_close(jt, fx, atol=1e-5, rtol=1e-5)  # fx rounds at 1e4 * 1e-16 / eps
    check_grads(lambda x: torch.logcumsumexp(x, 1), (x,), order=2)


def test_logcumsumexp_masked_float32():
    """A -inf mask and a -100 fill in float32 (exp(-100) underflows): finite derivatives,
    torch.func's elsewhere. At the -inf entry the derivative is 0 (-inf + eps t is -inf: the
    output does not move; torch's jvp says 0 too, its vjp NaN)."""
    x = _x((2, 5)).float()
    x[0, 0] = float("-inf")
    x[1, :2] = -100.0
    f = lambda x: torch.logcumsumexp(x, 1)  # noqa: E731
    ct, t = _x((2, 5), seed=1).float(), _x((2, 5), seed=2).float()
    g = ft.vjp(f, x)[1](ct)[0]
    jt = ft.jvp(f, (x,), (t,))[1]
    assert torch.isfinite(g).all() and torch.isfinite(jt).all()
    assert g[0, 0] == 0 and jt[0, 0] == 0
    ref_g = tf.vjp(f, x)[1](ct)[0]
    torch.testing.assert_close(g.flatten()[1:], ref_g.flatten()[1:])
    ref = f(x.double() + 1e-6 * t.double()) - f(x.double() - 1e-6 * t.double())
    torch.testing.assert_close(jt[1], (ref[1] / 2e-6).float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", [torch.cummax, torch.cummin])
def test_cummax_cummin(op):
    x = _x((4, 5))
    compare_with_torch_func(lambda x: op(x, 1)[0], (x,), order=2)
    compare_with_torch_func(lambda x: op(x, 0)[0], (_x(()),))


@pytest.mark.parametrize(
    "f",
    [
        lambda x: torch.cumprod(x, 1),
        lambda x: torch.logcumsumexp(x, 1),
        lambda x: torch.cummax(x, 1)[0],
        lambda x: x.cumsum(1),
    ],
)
@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)])
def test_vmap_of_vjp(f, in_dims):
    x = _with_zeros(_x((4, 3, 5)), [(1, 0, 2), (2, 1, 0)])
    c = _x((4, 3, 5), seed=2)
    xa = x if in_dims[0] == 0 else x[0]
    ca = c if in_dims[1] == 0 else c[0]
    ours = ft.vmap(lambda x, c: ft.vjp(f, x)[1](c)[0], in_dims)(xa, ca)
    ref = tf.vmap(lambda x, c: tf.vjp(f, x)[1](c)[0], in_dims)(xa, ca)
    torch.testing.assert_close(ours, ref)


def test_cumprod_second_order_finite_differences():
    x = _with_zeros(_x((6,)), [(2,)])
    check_grads(lambda x: torch.cumprod(x, 0), (x,), order=2)


@pytest.mark.parametrize("x", [1e-200, 1.0, -3.0])
def test_cumprod_over_a_single_element_is_the_identity(x):
    # out is x: the formula's ct * x / x underflowed to 0 at tiny x (hessian of cumprod(x)**2
    # was 4 where torch.func gives 2)
    x = torch.tensor([[x]], dtype=F64)
    f = lambda x: (x.cumprod(-1) ** 2).sum()  # noqa: E731
    torch.testing.assert_close(ft.grad(f)(x), 2 * x, rtol=1e-12, atol=0)
    torch.testing.assert_close(ft.hessian(f)(x), tf.hessian(f)(x))
    torch.testing.assert_close(ft.jvp(lambda x: x.cumprod(-1), (x,), (x,))[1], x)
