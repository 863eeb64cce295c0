"""Extreme eigenpairs found matrix-free (`eigsh` by Lanczos or LOBPCG) with the derivatives of
the eigenpairs themselves (Note [Implicit derivatives of eigenpairs], linalg/_eigen.py):
exact with fewer steps than n, under our transforms, torch.func and torch.autograd, against
dense float64 ``torch.linalg.eigh``."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft

DT = torch.float64
N = 30


def close(a, b, tol=1e-7):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _indefinite(n, seed):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=DT))
    return Q @ torch.diag(torch.linspace(-9, 9, n, dtype=DT) ** 3 / 50) @ Q.mT


def _sym(M):
    return (M + M.mT) / 2


M0 = _indefinite(N, 0)
WEIGHTS = torch.arange(N, dtype=DT)
METHODS = {"lanczos": dict(steps=24), "lobpcg": dict(method="lobpcg")}


def pairs(M, which="LA", k=3, **kw):
    return L.eigsh(L.DenseOperator(_sym(M), symmetric=True), k, which=which, **kw)


def dense_pairs(M, which="LA", k=3):
    e, U = torch.linalg.eigh(_sym(M))
    sel = slice(-k, None) if which == "LA" else slice(0, k)
    return e[sel], U[:, sel]


def values_fn(pairs_fn, which):
    return lambda M: (pairs_fn(M, which)[0] * torch.tensor([1.0, -2.0, 3.0], dtype=DT)).sum()


def vectors_fn(pairs_fn, which):
    # invariant to each eigenvector's sign: the weighted squares of its entries
    return lambda M: (pairs_fn(M, which)[1] ** 2).sum(-1) @ WEIGHTS


def _ours(method, which):
    return lambda M, w=which: pairs(M, w, **METHODS[method])


@pytest.mark.parametrize("which", ["LA", "SA"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("kind", [values_fn, vectors_fn])
def test_first_derivatives_are_the_eigenpairs_with_fewer_steps_than_n(kind, method, which):
    ours, want_f = kind(_ours(method, which), which), kind(dense_pairs, which)
    want = torch.func.grad(want_f)(M0)
    close(ft.grad(ours)(M0), want)
    close(torch.func.grad(ours)(M0), want)
    M = M0.clone().requires_grad_()
    close(torch.autograd.grad(ours(M), M)[0], want)
    T = torch.randn(N, N, generator=_gen(1), dtype=DT)
    tangent = torch.func.jvp(want_f, (M0,), (T,))[1]
    close(ft.jvp(ours, (M0,), (T,))[1], tangent)
    close(torch.func.jvp(ours, (M0,), (T,))[1], tangent)


# second order on a smaller matrix (the dense Hessian has n^4 entries); LOBPCG needs n >= 3 k
def _separated_top(n, seed):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=DT))
    evals = torch.cat([torch.linspace(-1, 1, n - 3, dtype=DT), torch.tensor([5.0, 7, 9])])
    return Q @ torch.diag(evals) @ Q.mT


M_SMALL = _separated_top(12, 9)
SMALL = {"lanczos": dict(steps=10), "lobpcg": dict(method="lobpcg")}


@pytest.mark.parametrize("method", list(SMALL))
@pytest.mark.parametrize("kind", [values_fn, vectors_fn])
def test_second_derivatives_are_exact(kind, method):
    n = M_SMALL.shape[0]
    ours = kind(lambda M, w: pairs(M, w, **SMALL[method]), "LA")
    want_f = kind(dense_pairs, "LA")
    weights = torch.arange(n, dtype=DT)
    if kind is vectors_fn:  # WEIGHTS is sized for M0
        ours = lambda M: (pairs(M, **SMALL[method])[1] ** 2).sum(-1) @ weights  # noqa: E731
        want_f = lambda M: (dense_pairs(M)[1] ** 2).sum(-1) @ weights  # noqa: E731
    want = torch.func.hessian(want_f)(M_SMALL)
    close(ft.hessian(ours)(M_SMALL), want, 1e-6)
    close(torch.func.hessian(ours)(M_SMALL), want, 1e-6)
    # torch's double backward
    M = M_SMALL.clone().requires_grad_()
    (g,) = torch.autograd.grad(ours(M), M, create_graph=True)
    V = torch.randn(n, n, generator=_gen(2), dtype=DT)
    (hv,) = torch.autograd.grad((g * V).sum(), M)
    close(hv, (want.reshape(n * n, n * n) @ V.reshape(-1)).reshape(n, n), 1e-6)


def test_second_derivative_of_a_function_linear_in_the_eigenvectors():
    # no rule's input depends on A but through the Newton steps' residuals
    W = torch.randn(N, 3, generator=_gen(8), dtype=DT)

    def linear(pairs_fn):
        return lambda M: (pairs_fn(M)[1] * W * torch.sign(pairs_fn(M)[1][:1])).sum()

    W = W[:12]
    want = torch.func.hessian(linear(dense_pairs))(M_SMALL)
    close(ft.hessian(linear(lambda M: pairs(M, steps=10)))(M_SMALL), want, 1e-6)


def test_third_derivatives_raise():
    x = torch.randn(12, 12, generator=_gen(3), dtype=DT)
    f = values_fn(lambda M, w: pairs(M, w, steps=10), "LA")
    with pytest.raises(NotImplementedError, match=r"order 3 of its eigenpairs.*eigh"):
        ft.jvp(ft.hessian(f), (M_SMALL,), (x,))


def test_structured_operators_are_differentiated_through_their_parameters():
    g = _gen(4)
    A, B = torch.randn(5, 5, generator=g, dtype=DT), torch.randn(6, 6, generator=g, dtype=DT)

    def spd(X):
        return X @ X.mT / 5 + torch.eye(X.shape[0], dtype=DT)

    def ours(A, B):
        op = L.KroneckerOperator(spd(A), spd(B), symmetric=True)
        return L.eigsh(op, 2, steps=20)[0].sum()

    def want(A, B):
        return torch.linalg.eigvalsh(torch.kron(spd(A), spd(B)))[-2:].sum()

    for a, b in zip(
        ft.grad(ours, argnums=(0, 1))(A, B), torch.func.grad(want, argnums=(0, 1))(A, B)
    ):
        close(a, b)
    U, d = torch.randn(40, 3, generator=g, dtype=DT), torch.linspace(1, 3, 40, dtype=DT)
    w = torch.arange(40, dtype=DT)

    def ours_lr(U, d):
        op = L.LowRankPlusDiagonalOperator(U, d)
        return (L.eigsh(op, 2, which="SA", steps=40)[1] ** 2).sum(-1) @ w

    def want_lr(U, d):
        return (torch.linalg.eigh(U @ U.mT + torch.diag(d))[1][:, :2] ** 2).sum(-1) @ w

    got, ref = (
        ft.grad(ours_lr, argnums=(0, 1))(U, d),
        torch.func.grad(want_lr, argnums=(0, 1))(U, d),
    )
    for a, b in zip(got, ref):
        close(a, b)


@pytest.mark.parametrize("method", list(METHODS))
def test_vmap_over_matrices_and_batched_operators(method):
    Ms = torch.stack([M0, 1.5 * M0, M0 - 0.3 * torch.eye(N, dtype=DT)])
    ours, want_f = values_fn(_ours(method, "LA"), "LA"), values_fn(dense_pairs, "LA")
    want = torch.func.vmap(torch.func.grad(want_f))(Ms)
    close(ft.vmap(ft.grad(ours))(Ms), want)  # the default start draws nothing: no randomness
    close(torch.func.vmap(torch.func.grad(ours))(Ms), want)
    vals, vecs = L.eigsh(L.DenseOperator(_sym(Ms), symmetric=True), 3, **METHODS[method])
    e, U = torch.linalg.eigh(_sym(Ms))
    close(vals, e[:, -3:], 1e-9)
    close((vecs * U[:, :, -3:]).sum(-2).abs(), torch.ones(3, 3, dtype=DT), 1e-9)


def test_complex_hermitian_eigenvalue_gradient():
    Z = torch.randn(16, 16, generator=_gen(5), dtype=torch.complex128)

    def ours(Z):
        return L.eigsh(L.DenseOperator((Z + Z.mH) / 2, symmetric=True), 2, steps=16)[0].sum()

    def want(Z):
        return torch.linalg.eigvalsh((Z + Z.mH) / 2)[-2:].sum()

    close(ft.grad(ours)(Z), torch.func.grad(want)(Z))


# ------------------------------------------------------------------ LOBPCG
@pytest.mark.parametrize("which", ["LA", "SA"])
def test_lobpcg_matches_eigh(which):
    n = 200  # separated extremes at both ends (LOBPCG without a preconditioner)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(6), dtype=DT))
    ends = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=DT)
    evals = torch.cat([ends, torch.linspace(2, 10, n - 8, dtype=DT), 20 + 10 * ends])
    A = Q @ torch.diag(evals) @ Q.mT
    with L.iterative() as it:
        vals, vecs = L.eigsh(L.DenseOperator(A, symmetric=True), 4, which=which, method="lobpcg")
    e, U = dense_pairs(A, which, 4)
    close(vals, e, 1e-8)
    close((vecs * U).sum(-2).abs(), torch.ones(4, dtype=DT), 1e-6)
    assert it.infos[0].method == "eigsh" and it.infos[0].converged


def test_lobpcg_preconditioner_speeds_up_the_smallest_pairs():
    d = torch.logspace(0, 4, 300, dtype=DT)  # ill conditioned: Jacobi is the exact inverse
    op = L.DiagonalOperator(d, positive_definite=True)
    with L.iterative() as plain:
        L.eigsh(op, 3, which="SA", method="lobpcg", maxiter=500)
    with L.iterative() as jacobi:
        vals, _ = L.eigsh(op, 3, which="SA", method="lobpcg", preconditioner="jacobi")
    close(vals, d[:3], 1e-8)
    assert jacobi.infos[0].iterations < plain.infos[0].iterations


def test_eigsh_refuses_bad_arguments_by_name():
    op = L.DenseOperator(_sym(M0), symmetric=True)
    with pytest.raises(ValueError, match=r"eigsh\(A, k=11, which='LA'\): LOBPCG needs n >= 3 k"):
        L.eigsh(op, 11, method="lobpcg")
    with pytest.raises(ValueError, match=r"expected method='lanczos' or 'lobpcg', received 'qr'"):
        L.eigsh(op, 2, method="qr")
    with pytest.raises(ValueError, match=r"a preconditioner needs method='lobpcg'"):
        L.eigsh(op, 2, preconditioner="jacobi")
    with pytest.raises(ValueError, match=r"expected v0 of shape \(\.\.\., 30, 2\) for LOBPCG"):
        L.eigsh(op, 2, method="lobpcg", v0=torch.ones(30, dtype=DT))


def test_default_start_is_fixed_and_a_generator_draws():
    a = pairs(M0, steps=12)[0]
    torch.testing.assert_close(pairs(M0, steps=12)[0], a, rtol=0, atol=0)
    b = pairs(M0, steps=12, generator=_gen(7))[0]
    assert not torch.equal(a, b)  # 12 steps: the start vector shows in the approximation
