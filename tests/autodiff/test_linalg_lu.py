"""The LU family, triangular_solve and the legacy cholesky (autodiff/linalg_lu.py) against
torch.func and finite differences: vjp, jvp, second order (hessian, jacfwd(jacrev)) and
vmap of the vjp. float64 and complex128, square, wide and tall, batched."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import FallbackWarning
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128
DTYPES = [pytest.param(F64, id="f64"), pytest.param(C128, id="c128")]
SHAPES = [pytest.param((4, 4), id="square"), pytest.param((3, 5), id="wide")]
SHAPES += [pytest.param((5, 3), id="tall")]

# torch.lu, torch.lu_solve and torch.triangular_solve are deprecated (a UserWarning per call)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
needs_legacy_cholesky = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "cholesky"), reason="torch.cholesky was removed in torch 2.15"
)


def _randn(*shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        re = torch.randn(shape, generator=g, dtype=F64)
        return torch.complex(re, torch.randn(shape, generator=g, dtype=F64))
    return torch.randn(shape, generator=g, dtype=dtype)


def _like(tree, seed):
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    out = [_randn(*x.shape, dtype=x.dtype, seed=seed + i) for i, x in enumerate(leaves)]
    return torch.utils._pytree.tree_unflatten(out, spec)


def close(a, b, rtol=1e-6, atol=1e-8):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def against_torch_func(f, args, *, jvp=True):
    """ft.vjp (and ft.jvp) of ``f`` equal torch.func's, with the same random directions."""
    out, vjp_fn = ft.vjp(f, *args)
    eout, evjp_fn = tf.vjp(f, *args)
    close(out, eout)
    cts = _like(eout, 11)
    close(vjp_fn(cts), evjp_fn(cts))
    if jvp:
        tangents = _like(tuple(args), 23)
        close(ft.jvp(f, tuple(args), tangents)[1], tf.jvp(f, tuple(args), tangents)[1])


def _lu_input(shape, dtype, batch=(2,), seed=0):
    return _randn(*batch, *shape, dtype=dtype, seed=seed)


def _wellcond(n, dtype, batch=(), seed=0):
    return _randn(*batch, n, n, dtype=dtype, seed=seed) / n**0.5 + 2 * torch.eye(n, dtype=dtype)


# -- factorizations -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_linalg_lu(dtype, shape):
    A = _lu_input(shape, dtype)
    against_torch_func(lambda A: torch.linalg.lu(A)[1:], (A,))
    check_grads(lambda A: torch.linalg.lu(A)[1:], (A[0],))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_lu_factor_and_legacy_lu(dtype, shape):
    A = _lu_input(shape, dtype)
    for f in (
        lambda A: torch.linalg.lu_factor(A)[0],
        lambda A: torch.linalg.lu_factor_ex(A)[0],
        lambda A: torch.lu(A)[0],
    ):
        against_torch_func(f, (A,))
    check_grads(lambda A: torch.linalg.lu_factor(A)[0], (A[1],))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_lu_unpack(dtype, shape):
    LU, piv = torch.linalg.lu_factor(_lu_input(shape, dtype))
    f = lambda LU: torch.lu_unpack(LU, piv)[1:]  # noqa: E731
    against_torch_func(f, (LU,))
    check_grads(f, (LU,))


def test_lu_second_order():
    A = _lu_input((4, 4), F64, batch=())
    check_grads(lambda A: torch.linalg.lu(A)[1:], (A,), order=2)
    W = _lu_input((3, 5), C128, batch=())
    check_grads(lambda A: torch.linalg.lu_factor(A)[0], (W,), order=2)


def test_lu_of_a_singular_matrix_gives_nan_as_torch():
    """A singular A has no LU derivative: the solves by U divide by its zero pivot (torch alike)."""
    A = torch.tensor([[1.0, 2, 3], [2, 4, 6], [1, 0, 1]], dtype=F64)
    f = lambda A: torch.linalg.lu(A)[2].sum()  # noqa: E731
    ours, ref = ft.grad(f)(A), tf.grad(f)(A)
    assert not ours.isfinite().all()
    assert torch.equal(ours.isnan(), ref.isnan())


# -- solves ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("adjoint", [False, True])
def test_linalg_lu_solve(dtype, left, adjoint):
    A = _wellcond(4, dtype, batch=(2,))
    LU, piv = torch.linalg.lu_factor(A)
    B = _randn(3, 1, 4, 2, dtype=dtype, seed=1)  # batch dims broadcast with LU's
    if not left:
        B = B.mT
    f = lambda LU, B: torch.linalg.lu_solve(LU, piv, B, left=left, adjoint=adjoint)  # noqa: E731
    against_torch_func(f, (LU, B))
    g = lambda LU, B: torch.linalg.lu_solve(LU, piv[0], B, left=left, adjoint=adjoint)  # noqa: E731
    check_grads(g, (LU[0], B[0, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_lu_solve(dtype):
    LU, piv = torch.linalg.lu_factor(_wellcond(4, dtype, batch=(2,)))
    f = lambda B, LU: torch.lu_solve(B, LU, piv)  # noqa: E731
    against_torch_func(f, (_randn(2, 4, 3, dtype=dtype, seed=2), LU))


@pytest.mark.parametrize("dtype", DTYPES)
def test_solve_through_lu_factor_equals_solve(dtype):
    """The factor-then-solve path differentiates to the derivative of solve (one function)."""
    A, B = _wellcond(4, dtype, batch=(2,)), _randn(2, 4, 3, dtype=dtype, seed=3)

    def via_lu(A, B):
        LU, piv = torch.linalg.lu_factor(A)
        return torch.linalg.lu_solve(LU, piv, B)

    cts = _randn(2, 4, 3, dtype=dtype, seed=4)
    close(ft.vjp(via_lu, A, B)[1](cts), ft.vjp(torch.linalg.solve, A, B)[1](cts))
    t = (_randn(2, 4, 4, dtype=dtype, seed=5), _randn(2, 4, 3, dtype=dtype, seed=6))
    close(ft.jvp(via_lu, (A, B), t)[1], ft.jvp(torch.linalg.solve, (A, B), t)[1])


def test_lu_solve_hessian():
    LU, piv = torch.linalg.lu_factor(_wellcond(3, F64, seed=7))
    B = _randn(3, 2, seed=8)

    def loss(LU, B):
        X = torch.linalg.lu_solve(LU, piv, B)
        return (X * X).sum() + X.sum()

    close(ft.hessian(loss, argnums=(0, 1))(LU, B), tf.hessian(loss, argnums=(0, 1))(LU, B))
    jfr = ft.jacfwd(ft.jacrev(loss, argnums=0), argnums=0)(LU, B)
    close(jfr, tf.jacfwd(tf.jacrev(loss, argnums=0), argnums=0)(LU, B))
    check_grads(lambda LU, B: torch.linalg.lu_solve(LU, piv, B, adjoint=True), (LU, B), order=2)


def test_lu_factor_then_solve_second_order_complex():
    A, B = _wellcond(3, C128, seed=9), _randn(3, 2, dtype=C128, seed=10)

    def f(A, B):
        LU, piv = torch.linalg.lu_factor(A)
        return torch.linalg.lu_solve(LU, piv, B, left=True, adjoint=False)

    check_grads(f, (A, B), order=2)


# -- triangular_solve -------------------------------------------------------------------------
def _tri_input(upper, dtype, batch=(2,), seed=0):
    T = _wellcond(4, dtype, batch=batch, seed=seed)
    return T.triu() if upper else T.tril()


FLAGS = [
    pytest.param(
        u, t, k, id=f"{'upper' if u else 'lower'}-{'T' if t else 'N'}-{'unit' if k else 'diag'}"
    )
    for u in (True, False)
    for t in (False, True)
    for k in (False, True)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper,transpose,unit", FLAGS)
def test_triangular_solve(dtype, upper, transpose, unit):
    A, B = _tri_input(upper, dtype), _randn(3, 1, 4, 2, dtype=dtype, seed=1)

    def f(B, A):
        return torch.triangular_solve(B, A, upper=upper, transpose=transpose, unitriangular=unit)

    # torch.func's vjp is right; its jvp is not (test_triangular_solve_jvp_finite_differences)
    against_torch_func(f, (B, A), jvp=False)
    check_grads(f, (B[0, 0], A[0]))  # full (not triangular) tangents of A
    if not transpose:  # torch.func's jvp agrees along directions inside the triangle
        tB, tA = _like((B, A), 5)
        tA = tA.triu(int(unit)) if upper else tA.tril(-int(unit))
        # torch.func's jvp fails when A's batch dims broadcast: compare on expanded inputs
        ours = ft.jvp(f, (B, A), (tB, tA))[1]
        big = (3, 2, 4, 4)
        bB = (3, 2, 4, 2)
        ref = tf.jvp(f, (B.expand(bB), A.expand(big)), (tB.expand(bB), tA.expand(big)))[1]
        close(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_triangular_solve_jvp_finite_differences(dtype, transpose):
    """Note: torch.func's jvp of triangular_solve (torch 2.13 and 2.15) reads dA outside the
    triangle the solve reads and ignores ``transpose``; finite differences side with ours (the
    conformance entries triangular_solve jvp / jvp(vjp) are kept as 'wrong value' for this)."""
    A, B = _tri_input(True, dtype, batch=()), _randn(4, 2, dtype=dtype, seed=1)
    f = lambda B, A: torch.triangular_solve(B, A, transpose=transpose)[0]  # noqa: E731
    tB, tA = _like((B, A), 7)
    eps = 1e-6
    fd = (f(B + eps * tB, A + eps * tA) - f(B - eps * tB, A - eps * tA)) / (2 * eps)
    close(ft.jvp(f, (B, A), (tB, tA))[1], fd, rtol=1e-5, atol=1e-6)
    # and the pullback of the vjp (the jvp(vjp) composition) against differences of torch's vjp
    c, tc = _randn(4, 2, dtype=dtype, seed=8), _randn(4, 2, dtype=dtype, seed=9)

    def pullback(B, A, c):
        return tf.vjp(f, B, A)[1](c)

    plus = pullback(B + eps * tB, A + eps * tA, c + eps * tc)
    minus = pullback(B - eps * tB, A - eps * tA, c - eps * tc)
    fd2 = tuple((p - m) / (2 * eps) for p, m in zip(plus, minus))
    ours = ft.jvp(lambda B, A, c: ft.vjp(f, B, A)[1](c), (B, A, c), (tB, tA, tc))[1]
    close(ours, fd2, rtol=1e-5, atol=1e-6)


def test_triangular_solve_second_order():
    A, B = _tri_input(False, F64, batch=(), seed=3), _randn(4, 2, seed=4)

    def loss(A):
        X = torch.triangular_solve(B, A, upper=False)[0]
        return (X * X).sum()

    # reverse over reverse in torch.func (its jvp is not used), forward over reverse in ours
    close(ft.jacfwd(ft.jacrev(loss))(A), tf.jacrev(tf.jacrev(loss))(A))
    close(ft.hessian(loss)(A), tf.jacrev(tf.jacrev(loss))(A))
    check_grads(lambda B, A: torch.triangular_solve(B, A, transpose=True)[0], (B, A.mT), order=2)


# -- legacy cholesky ---------------------------------------------------------------------------
@needs_legacy_cholesky
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper", [False, True])
def test_legacy_cholesky(dtype, upper):
    X = _randn(2, 4, 4, dtype=dtype, seed=12)
    S = X @ X.mH / 4 + torch.eye(4, dtype=dtype)
    f = lambda S: torch.cholesky(S, upper=upper)  # noqa: E731
    # torch has no forward-mode rule for torch.cholesky: the jvp is checked against
    # torch.linalg.cholesky's and finite differences (along Hermitian directions)
    against_torch_func(f, (S,), jvp=False)
    t = _randn(2, 4, 4, dtype=dtype, seed=13)
    t = t + t.mH
    close(
        ft.jvp(f, (S,), (t,))[1],
        tf.jvp(lambda S: torch.linalg.cholesky(S, upper=upper), (S,), (t,))[1],
    )
    check_grads(lambda X: f(X @ X.mH + torch.eye(4, dtype=dtype)), (X[0],), order=2)


# -- vmap of the derivatives: batching rules, never the per-example loop -----------------------
def test_vmap_of_vjp_batches_without_the_loop():
    As = _wellcond(4, F64, batch=(3,), seed=14)
    B = _randn(4, 2, seed=15)
    cts = _randn(3, 4, 2, seed=16)

    def f(A):
        LU, piv = torch.linalg.lu_factor(A)
        return torch.linalg.lu_solve(LU, piv, B) + torch.triangular_solve(B, A)[0]

    def pullback(A, c):
        return ft.vjp(f, A)[1](c)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = ft.vmap(pullback)(As, cts)
    close(ours, tf.vmap(lambda A, c: tf.vjp(f, A)[1](c)[0])(As, cts))


@pytest.mark.parametrize(
    "op",
    [pytest.param("cholesky", marks=needs_legacy_cholesky), "cholesky_inverse", "lu_unpack"]
    + ["solve_vector", "solve_matrix", "solve_right", "solve_A_batched"],
)
def test_vmap_rules(op):
    X = _randn(3, 4, 4, seed=17)
    S = X @ X.mT + torch.eye(4, dtype=F64)
    L = torch.linalg.cholesky(S)
    LU, piv = torch.linalg.lu_factor(X)
    b, B = _randn(3, 4, seed=18), _randn(3, 4, 2, seed=19)
    f, args, in_dims = {
        "cholesky": (lambda S: torch.cholesky(S, upper=True), (S,), 0),
        "cholesky_inverse": (torch.cholesky_inverse, (L,), 0),
        "lu_unpack": (torch.lu_unpack, (LU, piv), 0),
        "solve_vector": (torch.linalg.solve, (S, b), 0),
        "solve_matrix": (torch.linalg.solve, (S, B), 0),
        "solve_right": (lambda S, B: torch.linalg.solve(S, B.mT, left=False), (S, B), 0),
        "solve_A_batched": (torch.linalg.solve, (S, B[0]), (0, None)),
    }[op]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        ours = ft.vmap(f, in_dims)(*args)
    close(ours, tf.vmap(f, in_dims)(*args))
