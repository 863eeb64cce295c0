"""Root / inverse-root decompositions, sqrtm, stochastic diagonal estimation and the
pivoted-Cholesky preconditioner: against dense float64, with grad, jvp and vmap."""

import importlib

import functransforms.linalg as L
import pytest
import torch

DT = torch.float64
IMPLS = ["torch.func", "functransforms"]


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-7, "atol": 1e-9, **kw})


def _mod(impl):
    return torch.func if impl == "torch.func" else importlib.import_module("functransforms")


def _spd(n, seed):
    X = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=DT)
    return X @ X.mT / n + torch.eye(n, dtype=DT)


def _kron(A, B):
    return L.KroneckerOperator(
        A @ A.mT + torch.eye(2, dtype=DT), B @ B.mT + torch.eye(3, dtype=DT), positive_definite=True
    )


def _kron_dense(A, B):
    return torch.kron(A @ A.mT + torch.eye(2, dtype=DT), B @ B.mT + torch.eye(3, dtype=DT))


FNS = {
    # name -> (structured(A, B, v), dense(A, B, v))
    "root": (
        lambda A, B, v: L.root_decomposition(_kron(A, B)) @ v,
        lambda A, B, v: torch.linalg.cholesky(_kron_dense(A, B)) @ v,
    ),
    "root_inv": (
        lambda A, B, v: L.root_inv_decomposition(_kron(A, B)).mT @ v,
        lambda A, B, v: torch.linalg.inv(torch.linalg.cholesky(_kron_dense(A, B))) @ v,
    ),
    "sqrtm": (
        lambda A, B, v: L.sqrtm(_kron(A, B)) @ v,
        lambda A, B, v: _dense_sqrtm(_kron_dense(A, B)) @ v,
    ),
}


def _dense_sqrtm(M):
    e, Q = torch.linalg.eigh(M)
    return Q @ torch.diag_embed(e.sqrt()) @ Q.mT


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 2, generator=g, dtype=DT),
        torch.randn(3, 3, generator=g, dtype=DT),
        torch.randn(6, generator=g, dtype=DT),
    )


@pytest.mark.parametrize("name", FNS)
def test_values_and_structure(name):
    f, fd = FNS[name]
    A, B, v = _inputs()
    close(f(A, B, v), fd(A, B, v), rtol=1e-10, atol=1e-12)
    K = _kron(A, B)
    R = L.root_decomposition(K)
    assert isinstance(R, L.KroneckerOperator)
    close(R.to_dense() @ R.to_dense().mT, K.to_dense())
    S = L.root_inv_decomposition(K)
    close(S.to_dense() @ S.to_dense().mT, torch.linalg.inv(K.to_dense()))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FNS)
def test_grad_jvp_vmap(impl, name):
    ft = _mod(impl)
    f, fd = FNS[name]
    A, B, v = _inputs()
    w = torch.randn(6, dtype=DT, generator=torch.Generator().manual_seed(9))
    loss, dloss = (lambda *a: (f(*a) * w).sum()), (lambda *a: (fd(*a) * w).sum())
    close(
        ft.grad(loss, argnums=(0, 1, 2))(A, B, v),
        torch.func.grad(dloss, argnums=(0, 1, 2))(A, B, v),
    )
    t = _inputs(5)
    close(ft.jvp(f, (A, B, v), t), torch.func.jvp(fd, (A, B, v), t))
    batch = [_inputs(s) for s in range(3)]
    stacked = [torch.stack([b[k] for b in batch]) for k in range(3)]
    close(ft.vmap(f)(*stacked), torch.stack([fd(*b) for b in batch]))


def test_estimate_diagonal_is_unbiased_and_differentiable():
    M = _spd(30, 0)
    op = L.SumOperator([L.DenseOperator(M), L.LowRankOperator(torch.ones(30, 1, dtype=DT))])
    gen = torch.Generator().manual_seed(0)
    est = L.estimate_diagonal(op, num_probes=4000, generator=gen)
    D = op.to_dense()
    exact = D.diagonal()
    # entry j has standard deviation sqrt(sum_{k != j} A_jk^2 / p): every error within 4 of them
    std = ((D**2).sum(-1) - exact**2).div(4000).sqrt()
    assert ((est - exact).abs() < 4 * std).all(), ((est - exact) / std).abs().max()
    # exact for a diagonal operator, and linear in the operator: grad through it
    ft = importlib.import_module("functransforms")
    d = torch.rand(5, dtype=DT) + 1
    g = ft.grad(lambda d: L.estimate_diagonal(L.DiagonalOperator(d), num_probes=3).sum())(d)
    close(g, torch.ones(5, dtype=DT))


def test_pivoted_cholesky_preconditioner_cuts_cg_iterations_on_a_kernel():
    X = torch.rand(400, 1, generator=torch.Generator().manual_seed(0), dtype=DT)
    p = (torch.tensor(0.3, dtype=DT), torch.tensor(1.0, dtype=DT))
    K = L.KernelOperator(L.rbf, X, params=p, positive_definite=True)
    s = torch.tensor(1e-3, dtype=DT)
    Ks = L.SumOperator([K, L.ScaledIdentityOperator(s, 400)], positive_definite=True)
    b = torch.randn(400, generator=torch.Generator().manual_seed(1), dtype=DT)
    _, plain = L.cg(Ks, b, tol=1e-10, maxiter=4000)
    P = L.pivoted_cholesky_preconditioner(K, s, rank=15)
    x, pre = L.cg(Ks, b, tol=1e-10, preconditioner=P)
    assert pre.converged and pre.iterations < plain.iterations / 5, (pre, plain)
    close(x, torch.linalg.solve(Ks.to_dense(), b), rtol=1e-6, atol=1e-6)
    Lk = L.pivoted_cholesky(K, 15)
    rel = (K.to_dense() - Lk @ Lk.mT).abs().max() / K.to_dense().abs().max()
    assert rel < 1e-6, rel


def test_errors_restate_the_call():
    with pytest.raises(ValueError, match=r"root_decomposition\(A\): expected .* positive_definite"):
        L.root_decomposition(L.DenseOperator(_spd(3, 0)))
    with pytest.raises(ValueError, match=r"sqrtm\(A\): expected .* symmetric"):
        L.sqrtm(L.DenseOperator(torch.randn(3, 3, dtype=DT)))
