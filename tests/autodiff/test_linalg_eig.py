"""Derivatives of eig / eigvals and matrix_exp (autodiff/linalg_eig.py), and of stft, against
torch.func and finite differences. Eigenvectors enter only through phase-invariant functions
(abs(V), V diag(g(L)) V^-1): Note [Derivatives of eig]."""

from __future__ import annotations

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import IllDefinedDerivativeError
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128
DTYPES = [pytest.param(F64, id="f64"), pytest.param(C128, id="c128")]


def _randn(*shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        re = torch.randn(shape, generator=g, dtype=F64)
        return torch.complex(re, torch.randn(shape, generator=g, dtype=F64))
    return torch.randn(shape, generator=g, dtype=dtype)


def _close(a, b, atol=1e-8, rtol=1e-6):
    for x, y in zip(
        a if isinstance(a, (tuple, list)) else (a,), b if isinstance(b, (tuple, list)) else (b,)
    ):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def eig_abs(A):
    L, V = torch.linalg.eig(A)
    return L, V.abs()


def eig_function(A):
    """V diag(exp(L / 2)) V^-1: a matrix function, independent of the eigenvectors' gauge."""
    L, V = torch.linalg.eig(A)
    return torch.linalg.solve(V, V * torch.exp(L / 2).unsqueeze(-2), left=False)


EIG_FUNCTIONS = [eig_abs, eig_function, torch.linalg.eigvals]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", EIG_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("batch", [(), (2,)], ids=["single", "batched"])
def test_eig_jvp_vjp_match_torch_func(f, dtype, batch):
    A = _randn(*batch, 4, 4, dtype=dtype)
    T = _randn(*batch, 4, 4, dtype=dtype, seed=1)
    _close(ft.jvp(f, (A,), (T,)), tf.jvp(f, (A,), (T,)))
    out, fn = ft.vjp(f, A)
    out_ref, fn_ref = tf.vjp(f, A)
    cts = tuple(
        _randn(*o.shape, dtype=o.dtype, seed=2) for o in (out if isinstance(out, tuple) else (out,))
    )
    cts = cts if isinstance(out, tuple) else cts[0]
    _close(fn(cts), fn_ref(cts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", EIG_FUNCTIONS, ids=lambda f: f.__name__)
def test_eig_finite_differences_second_order(f, dtype):
    A = _randn(4, 4, dtype=dtype, seed=3)
    check_grads(f, (A,), order=2, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hessian_through_eigvals_matches_torch_func(dtype):
    def loss(A):
        L = torch.linalg.eigvals(A)
        return (L * L).real.sum() + L.abs().pow(3).sum()

    A = _randn(3, 3, dtype=F64, seed=4)
    if dtype.is_complex:  # torch.func.hessian takes real inputs: a complex A from two real ones
        loss_c = loss
        loss = lambda X: loss_c(torch.complex(X[0], X[1]))  # noqa: E731
        A = torch.stack([A, _randn(3, 3, seed=5)])
    _close(ft.hessian(loss)(A), tf.hessian(loss)(A))
    _close(ft.jacfwd(ft.jacrev(loss))(A), tf.hessian(loss)(A))


def test_eig_phase_dependent_loss_raises_as_torch():
    """A loss that depends on the eigenvectors' phases has no derivative: torch raises, so do we,
    also where torch.func cannot check (under vmap)."""
    A = _randn(4, 4, dtype=C128, seed=6)
    f = lambda A: torch.linalg.eig(A)[1].real.sum()  # noqa: E731
    leaf = A.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="linalg_eig_backward"):
        torch.autograd.grad(f(leaf), leaf)
    with pytest.raises(IllDefinedDerivativeError, match=r"phase.*abs\(V\)"):
        ft.grad(f)(A)
    cts = _randn(3, 4, 4, dtype=F64, seed=7)
    _, fn = ft.vjp(lambda A: torch.linalg.eig(A)[1].real, A)
    with pytest.raises(IllDefinedDerivativeError):
        ft.vmap(fn)(cts)
    ft.grad(lambda A: torch.linalg.eig(A)[1].abs().sum())(A)  # phase-invariant: fine


def test_eig_vmap_of_vjp_matches_torch_func():
    A = _randn(4, 4, dtype=F64, seed=8)
    cts = (_randn(3, 4, dtype=C128, seed=9), _randn(3, 4, 4, dtype=F64, seed=10))
    ours = ft.vmap(ft.vjp(eig_abs, A)[1])(cts)
    ref = tf.vmap(tf.vjp(eig_abs, A)[1])(cts)
    _close(ours, ref)


# -- matrix_exp --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [(), (2, 1)], ids=["single", "batched"])
def test_matrix_exp_jvp_vjp_match_torch_func(dtype, batch):
    A = _randn(*batch, 4, 4, dtype=dtype) / 2
    T = _randn(*batch, 4, 4, dtype=dtype, seed=1)
    f = torch.linalg.matrix_exp
    _close(ft.jvp(f, (A,), (T,)), tf.jvp(f, (A,), (T,)))
    _close(ft.vjp(f, A)[1](T), tf.vjp(f, A)[1](T))
    cts = torch.stack([T, 2 * T, _randn(*T.shape, dtype=dtype, seed=2)])
    _close(ft.vmap(ft.vjp(f, A)[1])(cts), tf.vmap(tf.vjp(f, A)[1])(cts))


def test_matrix_exp_hessian_and_finite_differences():
    A = _randn(3, 3, seed=11) / 2
    loss = lambda A: torch.linalg.matrix_exp(A).pow(2).sum()  # noqa: E731
    _close(ft.hessian(loss)(A), tf.hessian(loss)(A))
    check_grads(torch.linalg.matrix_exp, (A,), order=2)
    check_grads(torch.linalg.matrix_exp, (_randn(3, 3, dtype=C128, seed=12) / 2,), order=2)


# -- stft --------------------------------------------------------------------------------------
def test_stft_jvp_vjp_match_torch_func():
    """torch.stft transposes its result in place (aten.transpose_), run as aten.transpose.int."""
    x = _randn(2, 40, seed=13)
    window = torch.hann_window(8, dtype=F64)
    f = lambda x: torch.stft(x, 8, hop_length=3, window=window, return_complex=True)  # noqa: E731
    T = _randn(2, 40, seed=14)
    _close(ft.jvp(f, (x,), (T,)), tf.jvp(f, (x,), (T,)))
    ct = _randn(*f(x).shape, dtype=C128, seed=15)
    _close(ft.vjp(f, x)[1](ct), tf.vjp(f, x)[1](ct))
    check_grads(f, (x,), order=1)


def test_transpose_inplace_under_grad():
    x = _randn(3, 4, seed=16)
    f = lambda x: (x * 2).transpose_(0, 1).cumsum(0).sum()  # noqa: E731
    _close(ft.grad(f)(x), tf.grad(f)(x))


@pytest.mark.parametrize(
    "name,f",
    [
        ("eigh", lambda A: torch.linalg.eigh(A + A.mH)[1].real.sum()),
        ("svd U", lambda A: torch.linalg.svd(A)[0].real.sum()),
        ("svd Vh", lambda A: torch.linalg.svd(A, full_matrices=False)[2].imag.sum()),
    ],
)
def test_eigh_svd_phase_dependent_losses_raise_as_torch(name, f):
    """Note [Phase-dependent losses]: the same check for the eigh and SVD vjps."""
    A = _randn(4, 4, dtype=C128, seed=17)
    leaf = A.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="backward"):
        torch.autograd.grad(f(leaf), leaf)
    with pytest.raises(IllDefinedDerivativeError, match="phase"):
        ft.grad(f)(A)


def test_svd_phase_invariant_products_do_not_raise():
    """U Vh is invariant to the joint phase of U's and V's columns, though each alone is not."""
    A = _randn(4, 4, dtype=C128, seed=18)

    def f(A):
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        return (U @ Vh).real.sum()

    _close(ft.grad(f)(A), tf.grad(f)(A))
