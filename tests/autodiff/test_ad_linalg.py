"""Derivative rules of linear algebra, FFT and sorting ops (autodiff/linalg.py, fft.py,
sorting.py) against torch.func: vjp, jvp, grad of a real loss and, for some, jvp of grad
(second order); float64 and complex128, batched matrices. Eigenvector and singular-vector
outputs are checked through gauge-invariant functions (V f(L) V^H), as torch does."""

from __future__ import annotations

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128
DTYPES = [pytest.param(F64, id="f64"), pytest.param(C128, id="c128")]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=F64, seed=0):
    g = _gen(seed)
    if dtype.is_complex:
        return torch.complex(
            torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
        )
    return torch.randn(shape, generator=g, dtype=dtype)


def _eye(n, dtype):
    return torch.eye(n, dtype=dtype)


def spd(*batch, n=4, dtype=F64, seed=0):
    X = _randn(*batch, n, n, dtype=dtype, seed=seed)
    return X @ X.mH / n + _eye(n, dtype)


def wellcond(*batch, n=4, dtype=F64, seed=0):
    return _randn(*batch, n, n, dtype=dtype, seed=seed) / n**0.5 + 2 * _eye(n, dtype)


def tri(*batch, n=4, upper=False, dtype=F64, seed=0):
    X = _randn(*batch, n, n, dtype=dtype, seed=seed) / n**0.5
    X = X.triu() if upper else X.tril()
    return X + 2 * _eye(n, dtype)


def hermitian(*batch, n=4, dtype=F64, seed=0):
    """Well-separated eigenvalues (so eigenvector derivatives are well conditioned)."""
    X = _randn(*batch, n, n, dtype=dtype, seed=seed)
    Q = torch.linalg.qr(X)[0]
    lam = torch.arange(1, n + 1, dtype=F64) * 1.5 + 0.1 * torch.rand(
        *batch, n, generator=_gen(seed + 1), dtype=F64
    )
    return (Q * lam.to(dtype).unsqueeze(-2)) @ Q.mH


def _floating(x):
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _like(tree, seed):
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    out = [
        _randn(*x.shape, dtype=x.dtype, seed=seed + i) if _floating(x) else x
        for i, x in enumerate(leaves)
    ]
    return torch.utils._pytree.tree_unflatten(out, spec)


def close(a, b, rtol=1e-6, atol=1e-8):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _loss(f, w):
    """A real loss sum_i Re <w_i, f_i> + |f_i|^2 / 2: grad and jvp-of-grad apply to any f, and
    the output cotangents depend on the inputs (so second order differentiates them too)."""

    def loss(*args):
        out = f(*args)
        outs, _ = torch.utils._pytree.tree_flatten(out)
        ws, _ = torch.utils._pytree.tree_flatten(w)
        total = 0
        for o, wi in zip(outs, ws):
            p = (
                (o * wi.conj() + 0.5 * o * o.conj()).real
                if o.is_complex()
                else o * wi + 0.5 * o * o
            )
            total = total + p.sum()
        return total

    return loss


def check_all(f, args, *, second=False, rtol=1e-6, atol=1e-8):
    """ft.vjp / ft.jvp / ft.grad (and ft.jvp(ft.grad) if ``second``) agree with torch.func."""
    out, vjp_fn = ft.vjp(f, *args)
    eout, evjp_fn = tf.vjp(f, *args)
    close(out, eout, rtol, atol)
    cts = _like(eout, 11)
    close(vjp_fn(cts), evjp_fn(cts), rtol, atol)
    tangents = _like(tuple(args), 23)
    _, t = ft.jvp(f, tuple(args), tangents)
    _, et = tf.jvp(f, tuple(args), tangents)
    close(t, et, rtol, atol)
    argnums = tuple(range(len(args)))
    loss = _loss(f, cts)
    close(ft.grad(loss, argnums)(*args), tf.grad(loss, argnums)(*args), rtol, atol)
    if second:
        hvp = ft.jvp(ft.grad(loss, argnums), tuple(args), tangents)[1]
        ehvp = tf.jvp(tf.grad(loss, argnums), tuple(args), tangents)[1]
        close(hvp, ehvp, rtol * 10, atol * 10)


# -- Cholesky ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky(dtype, upper):
    check_all(lambda A: torch.linalg.cholesky(A, upper=upper), (spd(2, dtype=dtype),), second=True)


def test_cholesky_ex_and_check_grads():
    check_all(lambda A: torch.linalg.cholesky_ex(A)[0], (spd(3, n=3),))
    check_grads(lambda X: torch.linalg.cholesky(X @ X.mT + _eye(3, F64)), (_randn(3, 3),), order=2)


# -- solves ------------------------------------------------------------------------------------
SOLVE_SHAPES = [
    pytest.param((2, 3, 3), (2, 3, 2), True, id="matrix"),
    pytest.param((2, 3, 3), (2, 3), True, id="vector"),
    pytest.param((2, 3, 3), (3, 2), True, id="broadcast-B"),
    pytest.param((3, 3), (2, 3, 2), True, id="broadcast-A"),
    pytest.param((2, 3, 3), (2, 2, 3), False, id="right"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ashape,bshape,left", SOLVE_SHAPES)
def test_solve(dtype, ashape, bshape, left):
    A = wellcond(*ashape[:-2], n=3, dtype=dtype)
    B = _randn(*bshape, dtype=dtype, seed=1)
    check_all(lambda A, B: torch.linalg.solve(A, B, left=left), (A, B), second=bshape == (2, 3, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unit", [False, True])
def test_solve_triangular(dtype, upper, left, unit):
    A = tri(2, n=3, upper=upper, dtype=dtype)
    B = _randn(2, 3, 2, dtype=dtype, seed=1) if left else _randn(2, 2, 3, dtype=dtype, seed=1)

    def f(A, B):
        return torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unit)

    check_all(f, (A, B), second=not unit)


def test_solve_triangular_broadcast():
    check_all(
        lambda A, B: torch.linalg.solve_triangular(A, B, upper=False),
        (tri(n=3), _randn(2, 1, 3, 2, seed=1)),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_solve(dtype, upper):
    L = tri(2, n=3, upper=upper, dtype=dtype)
    B = _randn(2, 3, 2, dtype=dtype, seed=1)
    check_all(lambda B, L: torch.cholesky_solve(B, L, upper), (B, L), second=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inv(dtype):
    check_all(torch.linalg.inv, (wellcond(2, n=3, dtype=dtype),), second=True)
    check_all(lambda A: torch.linalg.inv_ex(A)[0], (wellcond(2, n=3, dtype=dtype),))


# -- determinants --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_det(dtype):
    check_all(torch.linalg.det, (wellcond(2, n=3, dtype=dtype),), second=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slogdet(dtype):
    A = wellcond(2, n=3, dtype=dtype)
    A = A * torch.tensor([1.0, -1.0], dtype=F64)[:, None, None]  # both signs of det
    check_all(lambda A: tuple(torch.linalg.slogdet(A)), (A,), second=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logdet(dtype):
    check_all(torch.logdet, (spd(2, n=3, dtype=dtype),), second=True)


def test_determinants_check_grads():
    A = wellcond(n=3)
    check_grads(torch.linalg.det, (A,), order=2)
    check_grads(lambda A: torch.linalg.slogdet(A)[1], (A,), order=2)
    check_grads(lambda A: torch.linalg.slogdet(A)[1], (wellcond(n=3, dtype=C128),), order=1)


# -- eigh, svd ----------------------------------------------------------------------------------
def _gauge_invariant_eigh(UPLO):
    def f(A):
        L, V = torch.linalg.eigh(A, UPLO=UPLO)
        return L, (V * torch.exp(L / 4).to(V.dtype).unsqueeze(-2)) @ V.mH

    return f


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("UPLO", ["L", "U"])
def test_eigh(dtype, UPLO):
    check_all(_gauge_invariant_eigh(UPLO), (hermitian(2, dtype=dtype),), second=True)


def test_eigh_real_eigenvectors():
    """Real eigenvectors are unique up to sign; both libraries take LAPACK's."""
    check_all(lambda A: torch.linalg.eigh(A)[1], (hermitian(2),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_eigvalsh(dtype):
    check_all(torch.linalg.eigvalsh, (hermitian(2, dtype=dtype),), second=True)


def _gauge_invariant_svd(full_matrices):
    def f(A):
        U, S, Vh = torch.linalg.svd(A, full_matrices=full_matrices)
        k = S.shape[-1]
        U, Vh = U[..., :k], Vh[..., :k, :]
        return S, (U * torch.exp(S / 4).to(U.dtype).unsqueeze(-2)) @ Vh, U @ U.mH, Vh.mH @ Vh

    return f


SVD_SHAPES = [
    pytest.param((2, 4, 4), id="square"),
    pytest.param((2, 5, 3), id="tall"),
    pytest.param((2, 3, 5), id="wide"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SVD_SHAPES)
def test_svd(dtype, shape):
    A = _randn(*shape, dtype=dtype)
    check_all(_gauge_invariant_svd(False), (A,), second=shape == (2, 5, 3))


@pytest.mark.parametrize("shape", SVD_SHAPES)
def test_svd_real_factors(shape):
    """Real singular vectors are unique up to sign; both libraries take LAPACK's."""
    check_all(lambda A: tuple(torch.linalg.svd(A, full_matrices=False)), (_randn(*shape),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_svdvals(dtype):
    check_all(torch.linalg.svdvals, (_randn(2, 5, 3, dtype=dtype),), second=True)


def test_svd_full_matrices():
    check_all(_gauge_invariant_svd(True), (_randn(2, 5, 3),))
    check_all(_gauge_invariant_svd(True), (_randn(4, 4, dtype=C128),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_norm_fro(dtype):
    check_all(torch.linalg.matrix_norm, (_randn(2, 3, 4, dtype=dtype),), second=True)


# -- FFT -----------------------------------------------------------------------------------------
NORMS = ["backward", "ortho", "forward"]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("n", [6, 7])
def test_rfft_irfft(norm, n):
    x = _randn(2, n)
    check_all(lambda x: torch.fft.rfft(x, norm=norm), (x,))
    check_all(lambda x: torch.fft.fft(x, norm=norm), (x,))  # r2c, onesided=False
    z = _randn(2, n // 2 + 1, dtype=C128, seed=3)
    check_all(lambda z: torch.fft.irfft(z, n=n, norm=norm), (z,))
    check_all(lambda z: torch.fft.hfft(z, n=n, norm=norm), (z,))


@pytest.mark.parametrize("norm", NORMS)
def test_fft_c2c(norm):
    z = _randn(2, 5, dtype=C128)
    check_all(lambda z: torch.fft.fft(z, norm=norm), (z,))
    check_all(lambda z: torch.fft.ifft(z, norm=norm), (z,))
    check_all(lambda z: torch.fft.fftn(z, dim=(0, 1), norm=norm), (z,))


@pytest.mark.parametrize("norm", NORMS)
def test_fft_multidim(norm):
    x = _randn(3, 4, 6)
    check_all(lambda x: torch.fft.rfft2(x, norm=norm), (x,))
    check_all(lambda x: torch.fft.rfftn(x, dim=(0, 2), norm=norm), (x,))
    z = _randn(3, 4, 4, dtype=C128, seed=5)
    check_all(lambda z: torch.fft.irfft2(z, s=(4, 6), norm=norm), (z,))
    check_all(lambda z: torch.fft.irfftn(z, s=(3, 7), dim=(0, 2), norm=norm), (z,))


def test_fft_second_order_and_check_grads():
    x = _randn(2, 7)
    check_all(
        lambda x: torch.fft.irfft(torch.fft.rfft(x) * torch.fft.rfft(x), n=7), (x,), second=True
    )
    check_grads(torch.fft.rfft, (x,), order=2)
    check_grads(lambda z: torch.fft.irfft(z, n=6), (_randn(5, 4, dtype=C128),), order=2)


# -- sorting and selection -------------------------------------------------------------------------
def _x(*shape, seed=0):
    """Distinct values (no ties): the derivative of a selection is then unique."""
    return (
        torch.randperm(int(torch.tensor(shape).prod()), generator=_gen(seed)).to(F64).reshape(shape)
        / 3
    )


SELECTIONS = {
    "sort": lambda x: torch.sort(x, dim=1)[0],
    "sort-desc": lambda x: torch.sort(x, dim=-1, descending=True)[0],
    "sort-stable": lambda x: torch.sort(x, dim=0, stable=True)[0],
    "msort": torch.msort,
    "topk": lambda x: torch.topk(x, 2, dim=1)[0],
    "topk-smallest": lambda x: torch.topk(x, 3, dim=0, largest=False)[0],
    "kthvalue": lambda x: torch.kthvalue(x, 2, dim=1)[0],
    "kthvalue-keepdim": lambda x: torch.kthvalue(x, 2, dim=0, keepdim=True)[0],
    "median-dim": lambda x: torch.median(x, dim=1)[0],
    "median-keepdim": lambda x: torch.median(x, dim=-1, keepdim=True)[0],
    "nanmedian-dim": lambda x: torch.nanmedian(x, dim=0)[0],
    "mode": lambda x: torch.mode(x, dim=1)[0],
    "median": torch.median,
    "max-dim": lambda x: torch.max(x, dim=1)[0],
    "min-dim": lambda x: torch.min(x, dim=0)[0],
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_selection(name):
    check_all(SELECTIONS[name], (_x(3, 5, 2) if name != "median" else _x(3, 5),))


def test_sort_second_order_and_check_grads():
    x = _x(4, 5)
    check_all(lambda x: torch.sort(x * x, dim=1)[0], (x,), second=True)
    check_grads(lambda x: torch.sort(x, dim=0)[0], (x,), order=2)
    check_grads(lambda x: torch.topk(x, 2)[0], (x,), order=1)


def test_median_ties_share_the_derivative():
    x = torch.tensor([1.0, 2.0, 2.0, 3.0, 2.0], dtype=F64)
    close(ft.grad(torch.median)(x), tf.grad(torch.median)(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fft_with_n_pads_and_crops(dtype):
    x = _randn(2, 5, dtype=dtype)
    check_all(lambda x: torch.fft.fft(x, n=8), (x,), second=True)
    check_all(lambda x: torch.fft.fft(x, n=3), (x,))
    check_all(lambda x: torch.nn.functional.pad(x, (1, -2), value=3.0), (x,))
    if dtype == F64:
        check_all(lambda x: torch.fft.rfft(x, n=9), (x,))


def test_max_dim_ties_follow_the_returned_index():
    """As sort/topk/median.dim here: the derivative goes to the returned index, as in torch."""
    x = torch.tensor([[1.0, 3.0, 3.0]], dtype=F64)
    close(
        ft.grad(lambda x: torch.max(x, 1)[0].sum())(x),
        tf.grad(lambda x: torch.max(x, 1)[0].sum())(x),
    )


def test_topk_second_order():
    """The vjp of a non-permuting selection scatters (scatter_add), itself differentiable."""
    x = _x(2, 5)
    check_all(lambda x: torch.topk(x, 2)[0] ** 2, (x,), second=True)


def test_jvp_of_complex_right_solve_has_no_lazy_conj():
    """_linalg_solve_ex(left=False) returns a lazily conjugated result for complex inputs (and
    so does its tangent, a right solve); values computed from them under jvp are right."""
    A, B = wellcond(n=3, dtype=C128), _randn(2, 3, dtype=C128, seed=1)

    def f(A):
        return (2 * torch.linalg.solve(A, B, left=False)).imag

    close(ft.jvp(f, (A,), (A,)), tf.jvp(f, (A,), (A,)))


def test_grad_of_complex_right_solve_value():
    """The same lazily conjugated result under grad (materialized by the core on wrapping)."""
    A, B = wellcond(n=3, dtype=C128), _randn(2, 3, dtype=C128, seed=1)

    def f(A):
        return (2 * torch.linalg.solve(A, B, left=False)).imag.sum()

    close(ft.grad_and_value(f)(A)[1], f(A))


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_cholesky_inverse(upper, dtype):
    g = torch.Generator().manual_seed(3)
    M = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    L = torch.linalg.cholesky(M @ M.mH + torch.eye(4, dtype=dtype), upper=upper)
    f = lambda L: torch.cholesky_inverse(L, upper=upper)  # noqa: E731
    c = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    torch.testing.assert_close(ft.vjp(f, L)[1](c), torch.func.vjp(f, L)[1](c))
    # jvp against finite differences, in the triangle the kernel reads and outside it:
    # torch.func's jvp of cholesky_inverse (torch 2.13) disagrees with finite differences
    t = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    if dtype.is_complex:  # a Cholesky factor's diagonal is real, and LAPACK reads it so
        t = t - 1j * torch.diag_embed(t.diagonal(0, -2, -1).imag)
    eps = 1e-6
    fd = (f(L + eps * t) - f(L - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(f, (L,), (t,))[1], fd, atol=1e-6, rtol=1e-5)
