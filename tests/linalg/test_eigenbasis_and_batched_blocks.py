"""The Kronecker-plus-noise eigenbasis nodes (Note [Kronecker plus noise in its eigenbasis]) and
block-diagonal operators of equal blocks as one batched operator: values and derivatives
against the dense float64 computation, under grad, jvp, vmap, hessian and torch.autograd."""

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft
from functransforms.testing import check_grads, check_vmap

DT = torch.float64
_G = torch.Generator().manual_seed(3)


def _rbf(x, ls):
    return torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ls**2)


# three factors of different sizes (the general k-factor path) and two (the matrix path);
# RBF factors with clusters of near-equal eigenvalues
_X = [torch.linspace(0, 1, n, dtype=DT) for n in (5, 4, 3)]
_Y3 = torch.randn(60, dtype=DT, generator=_G)
_Y2 = torch.randn(20, 2, dtype=DT, generator=_G)
P = torch.tensor([0.3, 0.4, 0.5, -2.0], dtype=DT)  # three length scales, log noise
T = torch.tensor([1.0, -0.5, 0.3, 0.7], dtype=DT)


def _ops(p, k):
    fs = [_rbf(x, p[i]) for i, x in enumerate(_X[:k])]
    n = 1
    for f in fs:
        n *= f.shape[-1]
    ours = L.KroneckerOperator(*fs, symmetric=True) + L.ScaledIdentityOperator(torch.exp(p[3]), n)
    dense = fs[0]
    for f in fs[1:]:
        dense = torch.kron(dense, f)
    return ours, dense + torch.exp(p[3]) * torch.eye(n, dtype=DT)


def _mll(k, dense):
    Y = _Y3 if k == 3 else _Y2

    def f(p):
        ours, D = _ops(p, k)
        K = D if dense else ours
        alpha = torch.linalg.solve(K, Y)
        return -0.5 * (Y * alpha).sum() - 0.5 * torch.logdet(K)

    return f


@pytest.mark.parametrize("k", [2, 3])
def test_kronecker_eigenbasis_matches_dense(k):
    ours, dense = _mll(k, False), _mll(k, True)
    assert type(_ops(P, k)[0]).__name__ == "KroneckerPlusScaledIdentityOperator"
    torch.testing.assert_close(ours(P), dense(P))
    tf = torch.func
    torch.testing.assert_close(ft.grad(ours)(P), tf.grad(dense)(P))
    torch.testing.assert_close(ft.jvp(ours, (P,), (T,))[1], tf.jvp(dense, (P,), (T,))[1])
    torch.testing.assert_close(ft.hessian(ours)(P), tf.hessian(dense)(P))
    torch.testing.assert_close(tf.hessian(ours)(P), tf.hessian(dense)(P))
    Ps = P + 0.02 * torch.arange(3, dtype=DT)[:, None]
    torch.testing.assert_close(ft.vmap(ft.grad(ours))(Ps), tf.vmap(tf.grad(dense))(Ps))
    # the oracle loops: torch.func's vmap of its hessian through the dense solve is wrong here
    # (entries ~1e14, torch 2.13)
    want = torch.stack([tf.hessian(dense)(q) for q in Ps])
    torch.testing.assert_close(ft.vmap(ft.hessian(ours))(Ps), want)
    p = P.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ours(p), p, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), p)
    torch.testing.assert_close(h, tf.hessian(dense)(P).sum(0))
    check_grads(ours, (P,), order=2)


def test_kronecker_eigenbasis_gradient_with_respect_to_the_factors():
    # the factors themselves as arguments: non-symmetric directions too (the second derivative
    # of log det is the one of the dense matrix, Γ ∘ E^T)
    A = _rbf(_X[0], 0.3)
    B = _rbf(_X[1], 0.4)
    s = torch.tensor(0.05, dtype=DT)
    y = torch.randn(20, dtype=DT, generator=_G)

    def ours(A, B, s):
        K = L.KroneckerOperator(A, B, symmetric=True) + L.ScaledIdentityOperator(s, 20)
        return y @ torch.linalg.solve(K, y) + torch.logdet(K)

    def dense(A, B, s):
        K = torch.kron(A, B) + s * torch.eye(20, dtype=DT)
        return y @ torch.linalg.solve(K, y) + torch.logdet(K)

    args = (A, B, s)
    for i in range(3):
        torch.testing.assert_close(
            ft.grad(ours, argnums=i)(*args), torch.func.grad(dense, argnums=i)(*args)
        )
    tA = torch.randn(5, 5, dtype=DT, generator=_G)  # not symmetric
    tB = torch.randn(4, 4, dtype=DT, generator=_G)
    tangents = (tA, tB, torch.tensor(0.3, dtype=DT))
    torch.testing.assert_close(
        ft.jvp(ours, args, tangents)[1], torch.func.jvp(dense, args, tangents)[1]
    )
    gA = lambda *a: ft.grad(ours)(*a)  # noqa: E731
    gA_dense = lambda *a: torch.func.grad(dense)(*a)  # noqa: E731
    torch.testing.assert_close(
        ft.jvp(gA, args, tangents)[1], torch.func.jvp(gA_dense, args, tangents)[1]
    )


def test_kronecker_eigenbasis_batched_factors_and_vmap():
    # native batch dimensions (one batched eigh per factor) agree with vmap and the loop
    Ps = P + 0.03 * torch.arange(4, dtype=DT)[:, None]  # [4, 4]
    x = _X[0]

    def batched(Ps):
        ls = Ps[..., 0, None, None]
        K1 = torch.exp(-0.5 * (x[:, None] - x[None, :]) ** 2 / ls**2)  # [4, 5, 5]
        K = L.KroneckerOperator(K1, _rbf(_X[1], 0.4), symmetric=True)
        Ky = K + L.ScaledIdentityOperator(torch.exp(Ps[..., 3]), 20)
        return torch.linalg.solve(Ky, _Y2[:, 0]).sum(-1) + torch.logdet(Ky)

    def single(p):
        return batched(p[None])[0]

    check_vmap(single, (Ps,))
    torch.testing.assert_close(batched(Ps), ft.vmap(single)(Ps))
    torch.testing.assert_close(
        ft.vmap(ft.grad(single))(Ps), torch.func.vmap(torch.func.grad(single))(Ps)
    )


def test_kronecker_eigenbasis_factorization_is_shared_and_refreshed():
    ours, _ = _ops(P, 2)
    y = _Y2[:, 0]
    torch.linalg.solve(ours, y)
    first = ours._eig_cache[1]
    torch.logdet(ours)
    assert ours._eig_cache[1] is first  # one eigendecomposition for the solve and the logdet
    A = ours.kron.factors[0].A
    A.mul_(2.0)  # written in place: recomputed
    D = torch.kron(A, ours.kron.factors[1].A) + ours.scale * torch.eye(20, dtype=DT)
    torch.testing.assert_close(torch.linalg.solve(ours, y), torch.linalg.solve(D, y))
    assert ours._eig_cache[1] is not first


_W = torch.randn(6, 3, 3, dtype=DT, generator=torch.Generator().manual_seed(5))


def _blocks(p, k=6, b=3):
    W = _W[:k, :b, :b]
    scale = 1 + torch.arange(k, dtype=DT)[:, None, None] * p[0] ** 2
    return W @ W.mT * scale + (1 + p[1] ** 2) * torch.eye(b, dtype=DT)


_YB = torch.randn(18, dtype=DT, generator=_G)


@pytest.mark.parametrize("form", ["tensor", "operator", "list"])
def test_batched_block_diagonal_matches_dense(form):
    def build(p):
        blocks = _blocks(p)
        if form == "tensor":
            return L.BlockDiagonalOperator(blocks, positive_definite=True)
        if form == "operator":
            return L.BlockDiagonalOperator(L.DenseOperator(blocks, positive_definite=True))
        return L.BlockDiagonalOperator([L.DenseOperator(B, positive_definite=True) for B in blocks])

    def ours(p):
        A = build(p)
        return _YB @ torch.linalg.solve(A, _YB) + torch.logdet(A) + (A @ _YB).sum()

    def dense(p):
        A = torch.block_diag(*_blocks(p))
        return _YB @ torch.linalg.solve(A, _YB) + torch.logdet(A) + (A @ _YB).sum()

    p = torch.tensor([0.7, 0.4], dtype=DT)
    A = build(p)
    assert isinstance(A, L.BatchedBlockDiagonalOperator)
    assert isinstance(A, L.BlockDiagonalOperator)
    D = torch.block_diag(*_blocks(p))
    torch.testing.assert_close(A.to_dense(), D)
    torch.testing.assert_close(_YB @ A, _YB @ D)
    torch.testing.assert_close(A.diagonal(), D.diagonal())
    torch.testing.assert_close(torch.trace(A), torch.trace(D))
    torch.testing.assert_close(torch.linalg.inv(A).to_dense(), torch.linalg.inv(D))
    torch.testing.assert_close(torch.linalg.cholesky(A).to_dense(), torch.linalg.cholesky(D))
    torch.testing.assert_close(torch.linalg.eigvalsh(A), torch.linalg.eigvalsh(D))
    torch.testing.assert_close((A @ A).to_dense(), D @ D)
    torch.testing.assert_close((A + A).to_dense(), D + D)
    torch.testing.assert_close((2.0 * A).to_dense(), 2.0 * D)
    torch.testing.assert_close(A.mT.to_dense(), D.mT)
    torch.testing.assert_close(ours(p), dense(p))
    tf = torch.func
    t = torch.tensor([1.0, -0.5], dtype=DT)
    torch.testing.assert_close(ft.grad(ours)(p), tf.grad(dense)(p))
    torch.testing.assert_close(ft.jvp(ours, (p,), (t,))[1], tf.jvp(dense, (p,), (t,))[1])
    torch.testing.assert_close(ft.hessian(ours)(p), tf.hessian(dense)(p))
    ps = p + 0.1 * torch.arange(3, dtype=DT)[:, None]
    torch.testing.assert_close(ft.vmap(ft.grad(ours))(ps), tf.vmap(tf.grad(dense))(ps))
    pr = p.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ours(pr), pr)
    torch.testing.assert_close(g, tf.grad(dense)(p))
    check_grads(ours, (p,), order=2)


def test_unequal_blocks_keep_the_list_form():
    A = L.BlockDiagonalOperator([torch.eye(2, dtype=DT), 2 * torch.eye(3, dtype=DT)])
    assert type(A) is L.BlockDiagonalOperator
    mixed = L.BlockDiagonalOperator(
        [L.DenseOperator(torch.eye(2, dtype=DT)), L.DiagonalOperator(torch.ones(2, dtype=DT))]
    )
    assert type(mixed) is L.BlockDiagonalOperator
    batched = L.BlockDiagonalOperator(torch.eye(2, dtype=DT).expand(3, 2, 2))
    # the general form's algebra still meets the batched one
    torch.testing.assert_close(
        (
            batched @ L.BlockDiagonalOperator([torch.eye(2, dtype=DT)] * 2 + [torch.eye(2)])
        ).to_dense(),
        torch.eye(6, dtype=DT),
    )


def test_batched_block_diagonal_batch_dimensions_and_pytree():
    blocks = _blocks(torch.tensor([0.7, 0.4], dtype=DT))
    batch = torch.stack([blocks, 2 * blocks])  # [2, 6, 3, 3]
    A = L.BlockDiagonalOperator(L.DenseOperator(batch, positive_definite=True))
    assert tuple(A.shape) == (2, 18, 18)
    D = torch.stack([torch.block_diag(*b) for b in batch])
    torch.testing.assert_close(A.to_dense(), D)
    torch.testing.assert_close(A[1].to_dense(), D[1])
    torch.testing.assert_close(torch.logdet(A), torch.logdet(D))
    torch.testing.assert_close(torch.linalg.solve(A, _YB), torch.linalg.solve(D, _YB))
    # blocks along the first dimension of a 4-D tensor (as the list form iterated it)
    B4 = L.BlockDiagonalOperator(batch.movedim(1, 0))
    torch.testing.assert_close(B4.to_dense(), D)
    out = ft.vmap(lambda op: torch.logdet(op), in_dims=0)(A)
    torch.testing.assert_close(out, torch.logdet(D))
