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
