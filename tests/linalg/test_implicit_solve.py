"""Structured solves and inverses are differentiated implicitly (Note [Implicit differentiation
of structured solves]), in every mode, against dense torch.func and finite differences."""

import functransforms.linalg as L
import pytest
import torch
from functransforms.linalg import KroneckerOperator, ScaledIdentityOperator

import functransforms as ft

DT = torch.float64


def _setup(n, seed=0, how="solve"):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 1, n, dtype=DT)
    y = torch.randn(n * n, dtype=DT, generator=g)

    def rbf(ls):
        return torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ls**2)

    def ours(ls, s):
        K = KroneckerOperator(rbf(ls[0]), rbf(ls[1]), symmetric=True, positive_definite=True)
        K = K + ScaledIdentityOperator(s, n * n)
        if how == "inv":  # inv(K) @ y must have the derivatives of solve(K, y)
            return y @ (torch.linalg.inv(K) @ y)
        return y @ torch.linalg.solve(K, y)

    def dense(ls, s):
        K = torch.kron(rbf(ls[0]), rbf(ls[1])) + s * torch.eye(n * n, dtype=DT)
        if how == "inv":
            return y @ (torch.linalg.inv(K) @ y)
        return y @ torch.linalg.solve(K, y)

    return ours, dense


# 16x16 RBF factors with length scale 0.3 have clusters of near-equal eigenvalues: the op-by-op
# derivative through their eigenvectors was wrong in forward mode.
ARGS = (torch.tensor([0.3, 0.25], dtype=DT), torch.tensor(0.01, dtype=DT))


@pytest.mark.parametrize("how", ["solve", "inv"])
def test_value_grad_jvp_match_dense(how):
    ours, dense = _setup(16, how=how)
    torch.testing.assert_close(ours(*ARGS), dense(*ARGS))
    for argnums in (0, 1):
        torch.testing.assert_close(
            ft.grad(ours, argnums=argnums)(*ARGS), torch.func.grad(dense, argnums=argnums)(*ARGS)
        )
    tangents = (torch.tensor([1.0, -0.5], dtype=DT), torch.tensor(0.3, dtype=DT))
    got = ft.jvp(ours, ARGS, tangents)[1]
    want = torch.func.jvp(dense, ARGS, tangents)[1]
    torch.testing.assert_close(got, want)
    eps = 1e-6
    fd = (
        ours(*(a + eps * t for a, t in zip(ARGS, tangents)))
        - ours(*(a - eps * t for a, t in zip(ARGS, tangents)))
    ) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("how", ["hessian", "jacfwd_jacrev", "jacrev_jacrev", "jacfwd_jacfwd"])
@pytest.mark.parametrize("op", ["solve", "inv"])
def test_second_order_matches_dense(how, op):
    ours, dense = _setup(10, how=op)
    ls = ARGS[0]
    f = lambda ls: ours(ls, ARGS[1])  # noqa: E731
    g = lambda ls: dense(ls, ARGS[1])  # noqa: E731
    a, b = how.split("_") if "_" in how else ("hessian", None)
    if b is None:
        got, want = ft.hessian(f)(ls), torch.func.hessian(g)(ls)
    else:
        got = getattr(ft, a)(getattr(ft, b)(f))(ls)
        # torch.func's jacfwd(jacfwd) through linalg.solve is off by a factor of 2 (forward over
        # forward of _linalg_solve_ex: see test_dense_solve_forward_over_forward_is_right): the
        # oracle is torch.func.hessian, which agrees with finite differences.
        oracle = torch.func.hessian if how == "jacfwd_jacfwd" else None
        want = oracle(g)(ls) if oracle else getattr(torch.func, a)(getattr(torch.func, b)(g))(ls)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("how", ["solve", "inv"])
def test_hessian_matches_finite_differences_of_grad(how):
    ours, _ = _setup(16, how=how)
    f = lambda ls: ours(ls, ARGS[1])  # noqa: E731
    H = ft.hessian(f)(ARGS[0])
    eps = 1e-6
    cols = []
    for i in range(2):
        e = torch.zeros(2, dtype=DT)
        e[i] = eps
        cols.append((ft.grad(f)(ARGS[0] + e) - ft.grad(f)(ARGS[0] - e)) / (2 * eps))
    torch.testing.assert_close(H, torch.stack(cols, -1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("how", ["solve", "inv"])
def test_vmap_of_jvp_and_grad(how):
    ours, dense = _setup(8, how=how)
    lss = torch.tensor([[0.3, 0.25], [0.4, 0.2], [0.5, 0.5]], dtype=DT)
    tans = torch.randn(3, 2, dtype=DT, generator=torch.Generator().manual_seed(1))

    def jv(fn, j):
        return lambda ls, t: j(lambda a: fn(a, ARGS[1]), (ls,), (t,))[1]

    torch.testing.assert_close(
        ft.vmap(jv(ours, ft.jvp))(lss, tans), torch.func.vmap(jv(dense, torch.func.jvp))(lss, tans)
    )
    torch.testing.assert_close(
        ft.vmap(ft.grad(lambda a: ours(a, ARGS[1])))(lss),
        torch.func.vmap(torch.func.grad(lambda a: dense(a, ARGS[1])))(lss),
    )


def test_grad_with_respect_to_right_hand_side():
    ours_n = 6
    x = torch.linspace(0, 1, ours_n, dtype=DT)
    K1 = torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / 0.3**2)
    s = torch.tensor(0.1, dtype=DT)
    B = torch.randn(ours_n * ours_n, 2, dtype=DT, generator=torch.Generator().manual_seed(2))

    def ours(B):
        K = KroneckerOperator(K1, K1, symmetric=True) + ScaledIdentityOperator(s, ours_n**2)
        return torch.linalg.solve(K, B).sin().sum()

    def dense(B):
        K = torch.kron(K1, K1) + s * torch.eye(ours_n**2, dtype=DT)
        return torch.linalg.solve(K, B).sin().sum()

    torch.testing.assert_close(ft.grad(ours)(B), torch.func.grad(dense)(B))
    torch.testing.assert_close(ft.hessian(ours)(B[:, :1]), torch.func.hessian(dense)(B[:, :1]))


def test_dense_solve_forward_over_forward_is_right():
    # f(a) = sum((a A0)^-1 b) = sum(A0^-1 b) / a: f'' = 2 sum(A0^-1 b) / a^3. Ours matches the
    # closed form and finite differences; torch.func.jvp(jvp) gives half of it (torch 2.13).
    g = torch.Generator().manual_seed(0)
    A0 = torch.randn(3, 3, dtype=DT, generator=g) + 3 * torch.eye(3, dtype=DT)
    b = torch.randn(3, dtype=DT, generator=g)
    x, one = torch.tensor(1.3, dtype=DT), torch.tensor(1.0, dtype=DT)

    def f(a):
        return torch.linalg.solve(A0 * a, b).sum()

    got = ft.jvp(lambda a: ft.jvp(f, (a,), (one,))[1], (x,), (one,))[1]
    exact = 2 * torch.linalg.solve(A0, b).sum() / x**3
    torch.testing.assert_close(got, exact)
    h = 1e-4
    torch.testing.assert_close(got, (f(x + h) - 2 * f(x) + f(x - h)) / h**2, rtol=1e-5, atol=1e-6)


def test_logdet_second_order_matches_dense():
    n = 12
    x = torch.linspace(0, 1, n, dtype=DT)
    s = ARGS[1]

    def rbf(ls):
        return torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ls**2)

    def ours(ls):
        K = KroneckerOperator(rbf(ls[0]), rbf(ls[1]), symmetric=True, positive_definite=True)
        return torch.logdet(K + ScaledIdentityOperator(s, n * n))

    def dense(ls):
        return torch.logdet(torch.kron(rbf(ls[0]), rbf(ls[1])) + s * torch.eye(n * n, dtype=DT))

    torch.testing.assert_close(ft.hessian(ours)(ARGS[0]), torch.func.hessian(dense)(ARGS[0]))
    t = (torch.tensor([1.0, 2.0], dtype=DT),)
    torch.testing.assert_close(
        ft.jvp(ours, (ARGS[0],), t)[1], torch.func.jvp(dense, (ARGS[0],), t)[1]
    )


@pytest.mark.parametrize("how", ["solve", "inv"])
def test_forward_mode_on_the_64x64_grid(how):
    # 64x64 RBF factors (length scales 0.3, 0.25) plus 0.01 I: forward mode through the factors'
    # eigendecompositions is wrong here (by a factor 4 for solve, of the wrong sign for inv(K) @ y),
    # so the rule must be the implicit one, which agrees with the gradient and finite differences in
    # both modes (dense torch.func at N = 4096 is too slow for a test).
    ours, _ = _setup(64, how=how)
    t = torch.tensor([1.0, -0.5], dtype=DT)
    jvp = ft.jvp(lambda ls: ours(ls, ARGS[1]), (ARGS[0],), (t,))[1]
    grad = ft.grad(ours)(*ARGS)
    torch.testing.assert_close(jvp, grad @ t)
    eps = 1e-6
    fd = (ours(ARGS[0] + eps * t, ARGS[1]) - ours(ARGS[0] - eps * t, ARGS[1])) / (2 * eps)
    torch.testing.assert_close(jvp, fd, rtol=1e-5, atol=1e-3)


def test_inverse_is_lazy_under_transforms_and_structured_outside():
    from functransforms.linalg import InverseOperator, ProductOperator

    n = 6
    x = torch.linspace(0, 1, n, dtype=DT)
    K1 = torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / 0.3**2)
    s = torch.tensor(0.1, dtype=DT)
    B = torch.randn(n * n, 3, dtype=DT, generator=torch.Generator().manual_seed(3))
    K = KroneckerOperator(K1, K1, symmetric=True) + ScaledIdentityOperator(s, n * n)
    assert not isinstance(torch.linalg.inv(K), InverseOperator)  # structured: no transform

    seen = []

    def ours(s):
        Ki = torch.linalg.inv(
            KroneckerOperator(K1, K1, symmetric=True) + ScaledIdentityOperator(s, n * n)
        )
        seen.append(type(Ki))
        # A^{-1} from the left and from the right, transposed, and its log-determinant
        return (Ki @ B).sum() + (B.mT @ Ki).sin().sum() + (Ki.mT @ B).cos().sum() + torch.logdet(Ki)

    def dense(s):
        Ki = torch.linalg.inv(torch.kron(K1, K1) + s * torch.eye(n * n, dtype=DT))
        return (Ki @ B).sum() + (B.mT @ Ki).sin().sum() + (Ki.mT @ B).cos().sum() + torch.logdet(Ki)

    torch.testing.assert_close(ours(s), dense(s))
    torch.testing.assert_close(ft.grad(ours)(s), torch.func.grad(dense)(s))
    assert seen == [ProductOperator, InverseOperator]
    one = torch.tensor(1.0, dtype=DT)
    torch.testing.assert_close(
        ft.jvp(ours, (s,), (one,))[1], torch.func.jvp(dense, (s,), (one,))[1]
    )


def test_second_derivative_outside_a_vmap_of_a_structured_solve():
    # the implicit solve's Function inside a vmap inside two differentiation levels: the
    # enclosing levels use its rules (Note [Generated vmap rules of autograd.Function])
    g = torch.Generator().manual_seed(0)
    b = torch.randn(4, dtype=torch.float64, generator=g)
    U = torch.randn(4, 2, dtype=torch.float64, generator=g)
    P = 0.3 * torch.randn(3, 4, dtype=torch.float64, generator=g)

    def one(p, structured):
        d = p.exp() + 1
        A = L.LowRankPlusDiagonalOperator(U, d) if structured else U @ U.mT + torch.diag(d)
        return (torch.linalg.solve(A, b) ** 2).sum()

    got = ft.hessian(lambda P: ft.vmap(lambda p: one(p, True))(P).sum())(P)
    for i, p in enumerate(P):
        want = torch.func.hessian(lambda p: one(p, False))(p)
        torch.testing.assert_close(got[i, :, i, :], want)
