"""Structure through algebra, declared properties, errors, and property-based Kronecker checks."""

import warnings

import functransforms.linalg as L
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

DT = torch.float64


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-8, "atol": 1e-9, **kw})


def _spd(n, seed):
    X = torch.randn(n, n, dtype=DT, generator=torch.Generator().manual_seed(seed))
    return X @ X.mT / n + torch.eye(n, dtype=DT)


def test_kronecker_algebra_keeps_structure():
    A, B, C, D = _spd(2, 0), _spd(3, 1), _spd(2, 2), _spd(3, 3)
    K1 = L.KroneckerOperator(A, B, positive_definite=True)
    K2 = L.KroneckerOperator(C, D, positive_definite=True)
    P = K1 @ K2
    assert isinstance(P, L.KroneckerOperator)  # (A ⊗ B)(C ⊗ D) = AC ⊗ BD
    close(P.to_dense(), torch.kron(A @ C, B @ D))
    Kinv = torch.linalg.inv(K1)
    assert isinstance(Kinv, L.KroneckerOperator) and Kinv.positive_definite
    close(Kinv.to_dense(), torch.linalg.inv(torch.kron(A, B)))
    Lf = torch.linalg.cholesky(K1)
    assert isinstance(Lf, L.KroneckerOperator) and Lf.lower and not Lf.upper
    noisy = K1 + L.ScaledIdentityOperator(torch.tensor(0.5, dtype=DT), 6)
    assert isinstance(noisy, L.KroneckerPlusScaledIdentityOperator) and noisy.positive_definite
    assert isinstance(K1 * 2.0, L.KroneckerOperator) and (K1 * 2.0).positive_definite
    assert not (K1 * -2.0).positive_definite and (K1 * -2.0).symmetric


def test_diagonal_and_low_rank_algebra():
    d1, d2 = torch.rand(4, dtype=DT) + 1, torch.rand(4, dtype=DT) + 1
    D1 = L.DiagonalOperator(d1, positive_definite=True)
    D2 = L.DiagonalOperator(d2, positive_definite=True)
    S = D1 + D2
    assert isinstance(S, L.DiagonalOperator) and S.positive_definite
    assert isinstance(D1 @ D2, L.DiagonalOperator)
    U = torch.randn(4, 2, dtype=DT)
    W = L.LowRankOperator(U) + D1
    assert isinstance(W, L.LowRankPlusDiagonalOperator) and W.positive_definite
    Winv = torch.linalg.inv(W)
    assert isinstance(Winv, L.LowRankPlusDiagonalOperator)  # Woodbury keeps the structure
    close(Winv.to_dense(), torch.linalg.inv(W.to_dense()))
    I = L.IdentityOperator(4, dtype=DT)
    assert (I @ W) is W and (W @ I) is W
    assert isinstance(
        L.ScaledIdentityOperator(torch.tensor(2.0, dtype=DT), 4) @ D1, L.DiagonalOperator
    )


def test_transpose_of_product_reverses():
    A = torch.randn(3, 4, dtype=DT)
    B = torch.randn(4, 5, dtype=DT)
    P = L.ProductOperator([L.DenseOperator(A), L.DenseOperator(B)])
    Pt = P.mT
    assert isinstance(Pt, L.ProductOperator)
    assert [tuple(op.shape) for op in Pt.ops] == [(5, 4), (4, 3)]
    close(Pt.to_dense(), (A @ B).mT)


def test_properties_propagate_through_transpose_and_inverse():
    Lt = L.TriangularOperator(torch.randn(4, 4, dtype=DT).tril() + 3 * torch.eye(4, dtype=DT))
    assert Lt.lower and not Lt.upper
    assert Lt.mT.upper and not Lt.mT.lower
    assert torch.linalg.inv(Lt).lower
    Q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=DT))
    U = L.DenseOperator(Q, unitary=True)
    assert torch.linalg.inv(U).unitary
    close(torch.linalg.solve(U, torch.ones(4, dtype=DT)), Q.mT @ torch.ones(4, dtype=DT))


def test_check_true_verifies_promises():
    A = torch.randn(4, 4, dtype=DT)
    with pytest.raises(
        ValueError,
        match=r"DenseOperator\(\.\.\., check=True\): declared properties do not hold: symmetric",
    ):
        L.DenseOperator(A, symmetric=True, check=True)
    with pytest.raises(ValueError, match="positive_definite"):
        L.DenseOperator(-torch.eye(3, dtype=DT), positive_definite=True, check=True)
    with pytest.raises(ValueError, match="unitary"):
        L.DenseOperator(2 * torch.eye(3, dtype=DT), unitary=True, check=True)
    L.DenseOperator(_spd(4, 0), positive_definite=True, check=True)  # a true promise passes


def test_cholesky_retries_with_jitter_and_warns():
    v = torch.randn(5, 1, dtype=DT, generator=torch.Generator().manual_seed(0))
    A = v @ v.mT  # PSD, rank 1: Cholesky fails without jitter
    op = L.DenseOperator(A, positive_definite=True)
    with pytest.warns(
        UserWarning, match=r"cholesky\(DenseOperator\): .* added jitter [0-9.e-]+ \* I"
    ):
        Lf = torch.linalg.cholesky(op)
    close(Lf.to_dense() @ Lf.to_dense().mT, A, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not positive definite even with jitter"):
        torch.linalg.cholesky(L.DenseOperator(-torch.eye(3, dtype=DT), positive_definite=True))


def test_errors_name_the_call():
    with pytest.raises(
        TypeError, match=r"DenseOperator\(A\): expected `A` to be a torch.Tensor, received list"
    ):
        L.DenseOperator([[1.0]])
    with pytest.raises(ValueError, match=r"matmul\(a, b\): inner dimensions differ"):
        L.DiagonalOperator(torch.ones(3, dtype=DT)) @ torch.ones(4, dtype=DT)
    with pytest.raises(ValueError, match=r"solve\(A, B\): expected a square operator"):
        L.solve(L.LowRankOperator(torch.ones(3, 1), torch.ones(2, 1)), torch.ones(3))
    with pytest.raises(ValueError, match=r"hadamard\(.*\): expected operators of one matrix shape"):
        L.DiagonalOperator(torch.ones(3)) * L.DiagonalOperator(torch.ones(4))
    with pytest.raises(
        ValueError, match=r"LowRankPlusDiagonalOperator\(U, d, V\): expected d of shape"
    ):
        L.LowRankPlusDiagonalOperator(torch.ones(3, 1), torch.ones(4))


def test_batch_broadcasting_like_tensors():
    A = torch.stack([_spd(2, s) for s in range(3)]).unsqueeze(1)  # (3, 1, 2, 2)
    B = torch.stack([_spd(3, s) for s in range(4)])  # (4, 3, 3)
    K = L.KroneckerOperator(A, B, positive_definite=True)
    assert K.batch_shape == (3, 4) and K.shape == (3, 4, 6, 6)
    dense = K.to_dense()
    b = torch.randn(6, dtype=DT)
    close(torch.linalg.solve(K, b), torch.linalg.solve(dense, b))
    close(torch.logdet(K), torch.logdet(dense))
    close(K[2, 1].to_dense(), dense[2, 1])
    close(K[:, 0].to_dense(), dense[:, 0])


def test_unsupported_op_falls_back_with_correct_dense_answer():
    op = L.DiagonalOperator(torch.tensor([1.0, 2.0], dtype=DT))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = torch.exp(op)
    close(out, torch.exp(op.to_dense()))


@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    k=st.integers(1, 2),
)
def test_kronecker_any_number_of_factors_matches_dense(sizes, seed, k):
    g = torch.Generator().manual_seed(seed)
    factors = []
    for n in sizes:
        X = torch.randn(n, n, generator=g, dtype=DT)
        factors.append(X @ X.mT / n + torch.eye(n, dtype=DT))
    K = L.KroneckerOperator(*factors, positive_definite=True)
    D = factors[0]
    for f in factors[1:]:
        D = torch.kron(D, f)
    N = D.shape[-1]
    X = torch.randn(N, k, generator=g, dtype=DT)
    close(K.to_dense(), D)
    close(K @ X, D @ X)
    close(torch.linalg.solve(K, X), torch.linalg.solve(D, X))
    close(torch.logdet(K), torch.logdet(D))
    close(torch.linalg.eigvalsh(K), torch.linalg.eigvalsh(D))
    s = torch.tensor(0.3, dtype=DT)
    Kn = K + L.ScaledIdentityOperator(s, N)
    close(torch.linalg.solve(Kn, X), torch.linalg.solve(D + s * torch.eye(N, dtype=DT), X))
    close(torch.logdet(Kn), torch.logdet(D + s * torch.eye(N, dtype=DT)))


@given(n=st.integers(2, 12), r=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_woodbury_and_determinant_lemma(n, r, seed):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(n, r, generator=g, dtype=DT)
    d = torch.rand(n, generator=g, dtype=DT) + 0.1
    op = L.LowRankPlusDiagonalOperator(U, d, positive_definite=True)
    D = torch.diag(d) + U @ U.mT
    b = torch.randn(n, generator=g, dtype=DT)
    close(torch.linalg.solve(op, b), torch.linalg.solve(D, b), rtol=1e-7, atol=1e-8)
    close(torch.logdet(op), torch.logdet(D))


@given(n=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_toeplitz_fft_matvec(n, seed):
    g = torch.Generator().manual_seed(seed)
    c, r = torch.randn(n, generator=g, dtype=DT), torch.randn(n, generator=g, dtype=DT)
    T = L.ToeplitzOperator(c, r)
    i = torch.arange(n)
    idx = i[:, None] - i[None, :]
    D = torch.where(idx >= 0, c[idx.clamp(min=0)], r[(-idx).clamp(min=0)])
    x = torch.randn(n, 3, generator=g, dtype=DT)
    close(T.to_dense(), D)
    close(T @ x, D @ x)
