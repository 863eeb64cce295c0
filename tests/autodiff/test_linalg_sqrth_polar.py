"""Derivatives of linalg.matrix_sqrth and linalg.polar (torch >= 2.15; autodiff/linalg_eig.py,
Note [Derivatives of matrix_sqrth and polar]) against torch.func: jvp, vjp, vmap(vjp) and
jvp(vjp), real and complex, including non-square polar inputs and tall batches."""

from __future__ import annotations

import pytest
import torch
import torch.func as tf

import functransforms as ft

pytestmark = pytest.mark.skipif(
    not (
        hasattr(torch.ops.aten, "linalg_matrix_sqrth") and hasattr(torch.ops.aten, "linalg_polar")
    ),
    reason="linalg.matrix_sqrth / linalg.polar are new in torch 2.15",
)

F64, C128 = torch.float64, torch.complex128


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64)
    if dtype.is_complex:
        x = torch.complex(x, torch.randn(shape, generator=g, dtype=F64))
    return x


def _hpd(n, dtype, seed):
    B = _randn(2, n, n, dtype=dtype, seed=seed)
    return B @ B.mT.conj() + 0.5 * torch.eye(n, dtype=dtype)


def _sqrth(A):
    return torch.linalg.matrix_sqrth(A)


def _polar(A):
    return tuple(torch.linalg.polar(A))


def _close(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-8, rtol=1e-6)


CASES = [
    pytest.param(_sqrth, lambda dt: _hpd(4, dt, 0), id="sqrth"),
    pytest.param(_polar, lambda dt: _randn(2, 4, 4, dtype=dt, seed=1), id="polar-square"),
    pytest.param(_polar, lambda dt: _randn(2, 5, 3, dtype=dt, seed=2), id="polar-tall"),
]


@pytest.mark.parametrize("dtype", [F64, C128], ids=["f64", "c128"])
@pytest.mark.parametrize(("fn", "make"), CASES)
def test_first_and_second_order_match_torch_func(fn, make, dtype):
    A = make(dtype)
    dA = _randn(*A.shape, dtype=dtype, seed=10)
    _close(ft.jvp(fn, (A,), (dA,)), tf.jvp(fn, (A,), (dA,)))

    out = fn(A)
    outs = out if isinstance(out, tuple) else (out,)
    bars = tuple(_randn(*o.shape, dtype=dtype, seed=20 + i) for i, o in enumerate(outs))
    bars = bars if isinstance(out, tuple) else bars[0]

    def pullback(vjp, A, bars):
        return vjp(fn, A)[1](bars)[0]

    _close(pullback(ft.vjp, A, bars), pullback(tf.vjp, A, bars))

    # vmap over a batch of cotangents
    batched = tuple(
        torch.stack([b, 2 * b + 1]) for b in (bars if isinstance(bars, tuple) else (bars,))
    )
    batched = batched if isinstance(bars, tuple) else batched[0]
    _close(
        ft.vmap(lambda b: pullback(ft.vjp, A, b))(batched),
        tf.vmap(lambda b: pullback(tf.vjp, A, b))(batched),
    )

    # jvp of the pullback, in A and in the cotangents
    dbars = tuple(_randn(*o.shape, dtype=dtype, seed=30 + i) for i, o in enumerate(outs))
    dbars = dbars if isinstance(out, tuple) else dbars[0]
    _close(
        ft.jvp(lambda a, b: pullback(ft.vjp, a, b), (A, bars), (dA, dbars)),
        tf.jvp(lambda a, b: pullback(tf.vjp, a, b), (A, bars), (dA, dbars)),
    )
