"""Every operator x every operation against the dense computation (to_dense() is ground truth)."""

import warnings

import functransforms.linalg as L
import pytest
import torch
from linalg_cases import CASES, DT

TOL = dict(rtol=1e-8, atol=1e-9)


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **{**TOL, **kw})


def _rhs(op, k=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (op.shape[-1],) if k is None else (op.shape[-1], k)
    return torch.randn(*shape, generator=g, dtype=DT)


@pytest.fixture(autouse=True)
def _no_fallback_warnings():
    # A structured rule must not fall back to dense silently or loudly in these tests.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no structured rule.*")
        yield


def cases(pred=lambda c: True):
    return [pytest.param(c, id=c.name) for c in CASES if pred(c)]


@pytest.mark.parametrize("case", cases())
def test_to_dense_matches_independent_construction(case):
    p, op = case.make()
    D = case.dense(*p)
    close(op.to_dense(), D)
    assert op.shape == D.shape and op.dtype == D.dtype and op.device == D.device
    assert op.batch_shape == D.shape[:-2]


@pytest.mark.parametrize("case", cases())
def test_matmul(case):
    p, op = case.make()
    D = case.dense(*p)
    x, X = _rhs(op), _rhs(op, 3)
    close(op @ x, D @ x)
    close(op @ X, D @ X)
    close(torch.matmul(op, X), D @ X)
    close(op.matmul(X), D @ X)
    y = torch.randn(op.shape[-2], dtype=DT, generator=torch.Generator().manual_seed(3))
    Y = torch.randn(2, op.shape[-2], dtype=DT, generator=torch.Generator().manual_seed(4))
    close(y @ op, y @ D)
    close(Y @ op, Y @ D)
    close(torch.matmul(Y, op), Y @ D)
    # batched right-hand sides broadcast like tensors
    Xb = (
        torch.randn(2, 1, op.shape[-1], 3, dtype=DT)
        if op.batch_shape
        else torch.randn(2, op.shape[-1], 3)
    )
    close(op @ Xb, D @ Xb)


@pytest.mark.parametrize("case", cases())
def test_transpose_adjoint(case):
    p, op = case.make()
    D = case.dense(*p)
    close(op.mT.to_dense(), D.mT)
    close(op.mH.to_dense(), D.mH)
    close(op.adjoint().to_dense(), D.mH)
    X = _rhs(op.mT, 2)
    close(op.mT @ X, D.mT @ X)
    if op.ndim == 2:
        close(op.T.to_dense(), D.T)
    else:
        with pytest.raises(ValueError, match=r"\.T: expected a 2-D operator"):
            _ = op.T


@pytest.mark.parametrize("case", cases())
def test_diagonal_trace_norm(case):
    p, op = case.make()
    D = case.dense(*p)
    close(op.diagonal(), D.diagonal(dim1=-2, dim2=-1))
    close(torch.diagonal(op, dim1=-2, dim2=-1), D.diagonal(dim1=-2, dim2=-1))
    close(torch.linalg.diagonal(op), D.diagonal(dim1=-2, dim2=-1))
    close(torch.linalg.matrix_norm(op), torch.linalg.matrix_norm(D))
    if op.is_square:
        close(L.trace(op), D.diagonal(dim1=-2, dim2=-1).sum(-1))
    if op.ndim == 2:
        close(torch.diag(op), torch.diag(D))
        close(torch.linalg.norm(op), torch.linalg.norm(D))
        if op.is_square:
            close(torch.trace(op), torch.trace(D))


@pytest.mark.parametrize("case", cases())
def test_indexing(case):
    p, op = case.make()
    D = case.dense(*p)
    close(op[..., 1, :], D[..., 1, :])
    close(op[..., :, 2], D[..., :, 2])
    close(op[..., 1:3, :], D[..., 1:3, :])
    close(op[..., :, [0, 2]], D[..., :, [0, 2]])
    close(op[..., 1:3, 0:2], D[..., 1:3, 0:2])
    close(op[..., 0, 1], D[..., 0, 1])
    if op.batch_shape:
        close(op[1].to_dense(), D[1])
        close(op[1:].to_dense(), D[1:])
        close(op[0, 1, :], D[0, 1, :])
        assert isinstance(op[1], L.LinearOperator)


@pytest.mark.parametrize("case", cases())
def test_scalar_mul_and_add(case):
    p, op = case.make()
    D = case.dense(*p)
    close((2.5 * op).to_dense(), 2.5 * D)
    close((op * torch.tensor(-0.5, dtype=DT)).to_dense(), -0.5 * D)
    close((op / 4).to_dense(), D / 4)
    close((-op).to_dense(), -D)
    close((op + op).to_dense(), 2 * D)
    close((op - 0.5 * op).to_dense(), 0.5 * D)
    E = torch.randn(op.shape[-2:], dtype=DT)
    close((op + E).to_dense(), D + E)
    close((E + op).to_dense(), D + E)
    X = _rhs(op, 2)
    close((op + op) @ X, 2 * D @ X)


@pytest.mark.parametrize("case", cases(lambda c: c.invertible))
def test_solve(case):
    p, op = case.make()
    D = case.dense(*p)
    x, X = _rhs(op), _rhs(op, 3)
    close(torch.linalg.solve(op, x), torch.linalg.solve(D, x))
    close(torch.linalg.solve(op, X), torch.linalg.solve(D, X))
    close(L.solve(op, X), torch.linalg.solve(D, X))
    Y = torch.randn(2, op.shape[-1], dtype=DT)
    close(torch.linalg.solve(op, Y, left=False), torch.linalg.solve(D, Y, left=False))
    close(torch.linalg.inv(op).to_dense(), torch.linalg.inv(D))
    close(torch.inverse(op) @ X, torch.linalg.inv(D) @ X)
    close(op.mT.__class__.__name__ and torch.linalg.solve(op.mT, X), torch.linalg.solve(D.mT, X))


@pytest.mark.parametrize("case", cases(lambda c: c.invertible))
def test_determinants(case):
    p, op = case.make()
    D = case.dense(*p)
    sign, logabs = torch.linalg.slogdet(op)
    esign, elogabs = torch.linalg.slogdet(D)
    close(sign, esign)
    close(logabs, elogabs)
    close(torch.slogdet(op)[1], elogabs)
    close(torch.linalg.det(op), torch.linalg.det(D))
    close(torch.det(op), torch.det(D))
    close(torch.logdet(op), torch.logdet(D), equal_nan=True)


@pytest.mark.parametrize("case", cases(lambda c: c.pd))
def test_cholesky(case):
    p, op = case.make()
    D = case.dense(*p)
    Lop = torch.linalg.cholesky(op)
    assert isinstance(Lop, L.LinearOperator)
    close(Lop.to_dense() @ Lop.to_dense().mT, D)
    close(Lop.to_dense(), torch.linalg.cholesky(D))
    close(torch.linalg.cholesky(op, upper=True).to_dense(), torch.linalg.cholesky(D, upper=True))
    B = _rhs(op, 2)
    close(torch.cholesky_solve(B, Lop), torch.linalg.solve(D, B))
    close(
        torch.linalg.solve_triangular(Lop, B, upper=False),
        torch.linalg.solve(torch.linalg.cholesky(D), B),
    )


@pytest.mark.parametrize("case", cases(lambda c: c.sym))
def test_eigh(case):
    p, op = case.make()
    D = case.dense(*p)
    evals, Q = torch.linalg.eigh(op)
    close(evals, torch.linalg.eigvalsh(D))
    close(torch.linalg.eigvalsh(op), torch.linalg.eigvalsh(D))
    Qd = Q.to_dense()
    close(Qd @ torch.diag_embed(evals) @ Qd.mT, D)
    close(Qd.mT @ Qd, torch.eye(op.shape[-1], dtype=DT).expand_as(D))


@pytest.mark.parametrize("case", cases(lambda c: c.is_square if hasattr(c, "is_square") else True))
def test_svd(case):
    p, op = case.make()
    D = case.dense(*p)
    U, S, Vh = torch.linalg.svd(op, full_matrices=False)
    close(S, torch.linalg.svdvals(D))
    close(torch.linalg.svdvals(op), torch.linalg.svdvals(D))
    k = S.shape[-1]
    Ud, Vhd = U.to_dense()[..., :k], Vh.to_dense()[..., :k, :]
    close(Ud @ torch.diag_embed(S) @ Vhd, D)


@pytest.mark.parametrize("case", cases(lambda c: c.tri is not None))
def test_solve_triangular(case):
    p, op = case.make()
    D = case.dense(*p)
    upper = case.tri == "upper"
    B = _rhs(op, 3)
    close(
        torch.linalg.solve_triangular(op, B, upper=upper),
        torch.linalg.solve_triangular(D, B, upper=upper),
    )
    Bl = torch.randn(2, op.shape[-1], dtype=DT)
    close(
        torch.linalg.solve_triangular(op, Bl, upper=upper, left=False),
        torch.linalg.solve_triangular(D, Bl, upper=upper, left=False),
    )


def test_repr_is_readable():
    A = torch.eye(2, dtype=DT)
    K = L.KroneckerOperator(A, L.DiagonalOperator(torch.ones(3, dtype=DT)), positive_definite=True)
    r = repr(K)
    assert r.startswith("KroneckerOperator(DenseOperator(shape=(2, 2)")
    assert "⊗ DiagonalOperator" in r and "shape=(6, 6)" in r and "positive_definite" in r
