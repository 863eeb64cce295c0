"""Complex operators: Hermitian means self-adjoint, adjoints conjugate, results match dense."""

import functransforms.linalg as L
import pytest
import torch

CT = torch.complex128


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def _hpd(n, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n, generator=g, dtype=CT)
    return X @ X.mH / n + torch.eye(n, dtype=CT)


def _ops():
    g = torch.Generator().manual_seed(0)
    U = torch.randn(5, 2, generator=g, dtype=CT)
    d = torch.rand(5, generator=g, dtype=torch.float64).to(CT) + 1
    return {
        "dense_hpd": (L.DenseOperator(_hpd(5, 1), positive_definite=True), _hpd(5, 1)),
        "diagonal": (L.DiagonalOperator(d * (1 + 0.5j)), torch.diag(d * (1 + 0.5j))),
        "lowrank_plus_diag_hpd": (
            L.LowRankPlusDiagonalOperator(U, d, positive_definite=True),
            torch.diag(d) + U @ U.mH,
        ),
        "kronecker_hpd": (
            L.KroneckerOperator(_hpd(2, 2), _hpd(3, 3), positive_definite=True),
            torch.kron(_hpd(2, 2), _hpd(3, 3)),
        ),
        "triangular": (
            L.TriangularOperator(_hpd(4, 4).tril() + 2 * torch.eye(4, dtype=CT)),
            _hpd(4, 4).tril() + 2 * torch.eye(4, dtype=CT),
        ),
    }


@pytest.mark.parametrize("name", list(_ops()))
def test_complex_operations_match_dense(name):
    op, D = _ops()[name]
    close(op.to_dense(), D)
    x = torch.randn(op.shape[-1], 2, dtype=CT)
    close(op @ x, D @ x)
    close(op.mH.to_dense(), D.mH)
    close(op.mT.to_dense(), D.mT)
    close(op.mH @ x, D.mH @ x)
    close(torch.linalg.solve(op, x), torch.linalg.solve(D, x))
    s, l = torch.linalg.slogdet(op)
    es, el = torch.linalg.slogdet(D)
    close(l, el)
    close(s, es)
    close(op.diagonal(), D.diagonal())
    close(torch.linalg.matrix_norm(op), torch.linalg.matrix_norm(D))
    if op.positive_definite:
        Lf = torch.linalg.cholesky(op).to_dense()
        close(Lf @ Lf.mH, D)
        close(torch.linalg.eigvalsh(op), torch.linalg.eigvalsh(D))
        close(torch.logdet(op), torch.logdet(D))
