"""KernelOperator (chunked, never stored whole) and inv_quad_logdet, against dense float64, with
grad, jvp and vmap (torch.func and ours) through the products, the solve and the log det."""

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


def _X(n=7, d=2, seed=0):
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _params():
    return torch.tensor([0.4, 1.3, 0.1], dtype=DT)  # lengthscale, variance, noise


@pytest.mark.parametrize("kernel", [L.rbf, L.matern52])
@pytest.mark.parametrize("chunk", [None, 3, 1])
def test_chunked_products_match_dense(kernel, chunk):
    X, Y = _X(), _X(5, seed=1)
    p = _params()[:2]
    K = L.KernelOperator(kernel, X, Y, params=tuple(p), chunk_size=chunk)
    D = kernel(X, Y, *p)
    close(K.to_dense(), D, rtol=1e-14, atol=1e-14)
    V = torch.randn(2, 5, 3, dtype=DT)
    close(K @ V, D @ V, rtol=1e-13, atol=1e-14)
    U = torch.randn(4, 7, dtype=DT)
    close(U @ K, U @ D, rtol=1e-13, atol=1e-14)
    close(K.mT.to_dense(), D.mT)
    S = L.KernelOperator(kernel, X, params=tuple(p), chunk_size=chunk)
    close(S.diagonal(), kernel(X, X, *p).diagonal())


def test_large_matmul_never_forms_the_matrix(monkeypatch):
    X = _X(3000, 3)
    p = (torch.tensor(0.2, dtype=DT), torch.tensor(1.0, dtype=DT))
    K = L.KernelOperator(L.rbf, X, params=p)
    largest = []

    def spy(A, B, *params):
        largest.append(A.shape[-2] * B.shape[-2])
        return L.rbf(A, B, *params)

    K.kernel = spy
    v = torch.randn(3000, dtype=DT)
    y = K @ v
    assert max(largest) <= 1 << 20 < 3000 * 3000
    close(y[:50], L.rbf(X[:50], X, *p) @ v, rtol=1e-12, atol=1e-12)


def _mll(theta, X, y, fused):
    ls, var, noise = theta[0], theta[1], theta[2]
    K = L.KernelOperator(L.rbf, X, params=(ls, var), chunk_size=3)
    Ky = L.SumOperator(
        [K, L.ScaledIdentityOperator(noise, X.shape[-2])], positive_definite=True
    )  # k + s² I, PD by construction
    if fused:
        quad, ld = L.inv_quad_logdet(Ky, y)
    else:
        quad, ld = y @ torch.linalg.solve(Ky, y), torch.logdet(Ky)
    return -0.5 * quad - 0.5 * ld


def _mll_dense(theta, X, y):
    Kd = L.rbf(X, X, theta[0], theta[1]) + theta[2] * torch.eye(X.shape[-2], dtype=DT)
    return -0.5 * y @ torch.linalg.solve(Kd, y) - 0.5 * torch.logdet(Kd)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fused", [True, False])
def test_marginal_likelihood_grad_jvp_vmap(impl, fused):
    ft = _mod(impl)
    X = _X()
    y = torch.randn(7, generator=torch.Generator().manual_seed(5), dtype=DT)
    theta = _params()
    close(_mll(theta, X, y, fused), _mll_dense(theta, X, y), rtol=1e-10, atol=1e-12)
    close(
        ft.grad(_mll, argnums=(0, 1, 2))(theta, X, y, fused),
        torch.func.grad(_mll_dense, argnums=(0, 1, 2))(theta, X, y),
    )
    t = (torch.randn_like(theta), torch.randn_like(X), torch.randn_like(y))
    close(
        ft.jvp(lambda a, b, c: _mll(a, b, c, fused), (theta, X, y), t),
        torch.func.jvp(_mll_dense, (theta, X, y), t),
    )
    thetas = theta * torch.tensor([[1.0], [1.5], [0.7]], dtype=DT)
    close(
        ft.vmap(_mll, in_dims=(0, None, None, None))(thetas, X, y, fused),
        torch.stack([_mll_dense(th, X, y) for th in thetas]),
    )


def test_inv_quad_logdet_matrix_rhs_and_structured():
    A = L.LowRankPlusDiagonalOperator(
        torch.randn(6, 2, dtype=DT), torch.rand(6, dtype=DT) + 1, positive_definite=True
    )
    B = torch.randn(6, 3, dtype=DT)
    q, ld = L.inv_quad_logdet(A, B)
    D = A.to_dense()
    close(q, (B * torch.linalg.solve(D, B)).sum())
    close(ld, torch.logdet(D))
    with pytest.raises(ValueError, match=r"inv_quad_logdet\(A, b\): expected .* positive_definite"):
        L.inv_quad_logdet(L.DenseOperator(D), B)


def test_vmap_over_the_operator_and_batch_indexing():
    ft = importlib.import_module("functransforms")
    X = torch.rand(3, 4, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    ls, var = torch.rand(3, dtype=DT) + 0.5, torch.ones(3, dtype=DT)
    K = L.KernelOperator(L.rbf, X, params=(ls, var))  # per-example params: vmap them
    b = torch.randn(4, dtype=DT)
    out = ft.vmap(lambda A, b: A @ b, in_dims=(0, None))(K, b)
    close(out, torch.stack([L.rbf(X[i], X[i], ls[i], var[i]) @ b for i in range(3)]))
    with pytest.raises(NotImplementedError, match="params are broadcast by the kernel"):
        K[0]
    K0 = L.KernelOperator(L.rbf, X, params=(torch.tensor(0.5, dtype=DT), torch.tensor(1.0)))
    close(K0[1].to_dense(), L.rbf(X[1], X[1], 0.5, 1.0))
