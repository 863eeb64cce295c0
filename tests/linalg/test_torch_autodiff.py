"""Structured solves, inverses and log determinants give the same exact derivatives under
torch.autograd (first and second order), torch.func (grad, jvp, jacfwd, jacrev, vmap) and our
transforms: against the dense float64 computation differentiated by torch and finite
differences (Note [Implicit differentiation of structured solves])."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft

DT = torch.float64
N = 6
_G = torch.Generator().manual_seed(0)
_X = torch.linspace(0, 1, N, dtype=DT)
_U = torch.randn(N * N, 2, dtype=DT, generator=_G)
_W = torch.randn(N, N, dtype=DT, generator=_G)
Y = torch.randn(N * N, dtype=DT, generator=_G)


def _rbf(ls):
    return torch.exp(-0.5 * (_X[:, None] - _X[None, :]) ** 2 / ls**2)


def _spd(t):
    return _W @ _W.mT * t**2 / N + torch.eye(N, dtype=DT) * (1 + t**2)


def _eye(n=N * N):
    return torch.eye(n, dtype=DT)


# name -> (operator of the parameters p (a [3] tensor), its dense matrix). RBF factors with
# length scales ~0.3 have clusters of near-equal eigenvalues: the Kronecker + noise case is where
# differentiating the factors' eigendecompositions gave wrong forward-mode derivatives.
CASES = {
    "kronecker_plus_noise": (
        lambda p: (
            L.KroneckerOperator(_rbf(p[0]), _rbf(p[1]), symmetric=True)
            + L.ScaledIdentityOperator(torch.exp(p[2]), N * N)
        ),
        lambda p: torch.kron(_rbf(p[0]), _rbf(p[1])) + torch.exp(p[2]) * _eye(),
    ),
    "kronecker": (
        lambda p: L.KroneckerOperator(_spd(p[0]), _spd(p[1] * p[2]), positive_definite=True),
        lambda p: torch.kron(_spd(p[0]), _spd(p[1] * p[2])),
    ),
    "low_rank_plus_diagonal": (
        lambda p: L.LowRankPlusDiagonalOperator(
            _U * p[0], torch.exp(p[1] * _X.repeat(N)) + p[2] ** 2, positive_definite=True
        ),
        lambda p: (
            (_U * p[0]) @ (_U * p[0]).mT + torch.diag(torch.exp(p[1] * _X.repeat(N)) + p[2] ** 2)
        ),
    ),
    "diagonal": (
        lambda p: L.DiagonalOperator(torch.exp(p[0] * _X.repeat(N)) + p[1] ** 2 + p[2]),
        lambda p: torch.diag(torch.exp(p[0] * _X.repeat(N)) + p[1] ** 2 + p[2]),
    ),
    "block_diagonal": (
        lambda p: L.BlockDiagonalOperator(
            [L.DenseOperator(_spd(p[0]), positive_definite=True)] * (N - 1)
            + [L.DenseOperator(_spd(p[1] + p[2]), positive_definite=True)]
        ),
        lambda p: torch.block_diag(*([_spd(p[0])] * (N - 1) + [_spd(p[1] + p[2])])),
    ),
}
P0 = torch.tensor([0.3, 0.27, -2.0], dtype=DT)  # [3]
T0 = torch.tensor([1.0, -0.5, 0.3], dtype=DT)  # a tangent, [3]
FUNCS = {
    "solve": lambda K: Y @ torch.linalg.solve(K, Y),
    "inv": lambda K: Y @ (torch.linalg.inv(K) @ Y),
    "logdet": torch.logdet,
}


def _fns(case, func):
    build, dense = CASES[case]
    f = FUNCS[func]
    return (lambda p: f(build(p))), (lambda p: f(dense(p)))


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("func", list(FUNCS))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_autograd_first_and_second_order(case, func):
    ours, dense = _fns(case, func)
    p = P0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ours(p), p, create_graph=True)
    pd = P0.clone().requires_grad_(True)
    (gd,) = torch.autograd.grad(dense(pd), pd, create_graph=True)
    _close(g, gd)
    H = torch.stack([torch.autograd.grad(g[i], p, retain_graph=True)[0] for i in range(3)])
    Hd = torch.stack([torch.autograd.grad(gd[i], pd, retain_graph=True)[0] for i in range(3)])
    _close(H, Hd)
    eps = 1e-6
    fd = torch.stack(
        [(ours(P0 + eps * e) - ours(P0 - eps * e)) / (2 * eps) for e in torch.eye(3, dtype=DT)]
    )
    torch.testing.assert_close(g.detach(), fd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("func", list(FUNCS))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_func_transforms(case, func):
    ours, dense = _fns(case, func)
    tf = torch.func
    _close(tf.grad(ours)(P0), tf.grad(dense)(P0))
    _close(tf.jvp(ours, (P0,), (T0,))[1], tf.jvp(dense, (P0,), (T0,))[1])
    _close(tf.jacfwd(ours)(P0), tf.jacrev(dense)(P0))
    _close(tf.hessian(ours)(P0), tf.hessian(dense)(P0))
    _close(tf.jacrev(tf.jacrev(ours))(P0), tf.hessian(dense)(P0))
    Ps = P0 + 0.01 * torch.arange(3, dtype=DT)[:, None]  # [3, 3]: three parameter settings
    _close(tf.vmap(tf.grad(ours))(Ps), tf.vmap(tf.grad(dense))(Ps))
    eps = 1e-6
    fd = (ours(P0 + eps * T0) - ours(P0 - eps * T0)) / (2 * eps)
    torch.testing.assert_close(tf.jvp(ours, (P0,), (T0,))[1], fd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("func", list(FUNCS))
@pytest.mark.parametrize("case", list(CASES))
def test_our_transforms_give_the_same_derivatives(case, func):
    ours, dense = _fns(case, func)
    tf = torch.func
    _close(ft.grad(ours)(P0), tf.grad(dense)(P0))
    _close(ft.jvp(ours, (P0,), (T0,))[1], tf.jvp(dense, (P0,), (T0,))[1])
    _close(ft.hessian(ours)(P0), tf.hessian(dense)(P0))
    Ps = P0 + 0.01 * torch.arange(3, dtype=DT)[:, None]
    _close(ft.vmap(ft.grad(ours))(Ps), tf.vmap(tf.grad(dense))(Ps))


def test_kronecker_plus_noise_jvp_near_equal_eigenvalues():
    """A 16 x 16 grid whose RBF factors have near-equal eigenvalues: torch.func.jvp through
    the solve used to differentiate the factors' eigenvectors (relative error ~10)."""
    n = 16
    x = torch.linspace(0, 1, n, dtype=DT)
    y = torch.randn(n * n, dtype=DT, generator=torch.Generator().manual_seed(1))

    def rbf(ls):
        return torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ls**2)

    def ours(ls):
        K = L.KroneckerOperator(rbf(ls), rbf(1.3 * ls), symmetric=True)
        return torch.linalg.solve(K + L.ScaledIdentityOperator(torch.tensor(0.01), n * n), y)

    def dense(ls):
        return torch.linalg.solve(
            torch.kron(rbf(ls), rbf(1.3 * ls)) + 0.01 * torch.eye(n * n, dtype=DT), y
        )

    ls, t = torch.tensor(0.3, dtype=DT), torch.tensor(1.0, dtype=DT)
    want = torch.func.jvp(dense, (ls,), (t,))[1]
    torch.testing.assert_close(torch.func.jvp(ours, (ls,), (t,))[1], want)
    torch.testing.assert_close(ft.jvp(ours, (ls,), (t,))[1], want)
    with torch.autograd.forward_ad.dual_level():
        out = ours(torch.autograd.forward_ad.make_dual(ls, t))
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(out).tangent, want)


@pytest.mark.parametrize("op", ["solve", "logdet"])
def test_third_derivatives_of_a_kronecker_plus_noise_are_refused(op):
    ours, _ = _fns("kronecker_plus_noise", op)
    with pytest.raises(NotImplementedError, match="order 3"):
        torch.func.jacfwd(torch.func.hessian(ours))(P0)
    with pytest.raises(NotImplementedError, match="order 3"):
        ft.jacfwd(ft.hessian(ours))(P0)
    p = P0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ours(p), p, create_graph=True)
    (h,) = torch.autograd.grad(g[0], p, create_graph=True)
    with pytest.raises(NotImplementedError, match="order 3"):
        torch.autograd.grad(h[0], p)
