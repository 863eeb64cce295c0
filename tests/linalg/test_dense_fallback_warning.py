"""A structured operator without a structured algorithm for a function warns once (per
operator class, function and call site) that it runs densely, naming the operator and size."""

import warnings

import functransforms.linalg as L
import pytest
import torch

from functransforms.errors import DenseFallbackWarning

DT = torch.float64


def _kron_plus_diagonal():
    A = torch.eye(8, dtype=DT) * 2
    d = torch.rand(64, dtype=DT, generator=torch.Generator().manual_seed(0)) + 1
    return L.KroneckerOperator(A, A, positive_definite=True) + L.DiagonalOperator(d)


def _solve_twice(K, b):
    return [torch.linalg.solve(K, b) for _ in range(2)]  # one call site, two calls


def test_kronecker_plus_diagonal_solve_warns_once_with_operator_and_size():
    L._base._DENSE_WARNED.clear()
    K, b = _kron_plus_diagonal(), torch.ones(64, dtype=DT)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        xs = _solve_twice(K, b)
        torch.linalg.solve(K, b)  # another call site: warned again
    msgs = [str(x.message) for x in w if issubclass(x.category, DenseFallbackWarning)]
    assert len(msgs) == 2
    assert "solve of SumOperator" in msgs[0] and "64 x 64" in msgs[0]
    assert "KroneckerOperator" in msgs[0] and "DiagonalOperator" in msgs[0]
    assert all(x.filename == __file__ for x in w if issubclass(x.category, DenseFallbackWarning))
    torch.testing.assert_close(xs[0], torch.linalg.solve(K.to_dense(), b))


@pytest.mark.parametrize(
    "call", [torch.logdet, torch.linalg.cholesky, torch.linalg.eigh, torch.linalg.slogdet]
)
def test_other_dense_algorithms_warn(call):
    L._base._DENSE_WARNED.clear()
    with pytest.warns(DenseFallbackWarning, match="SumOperator"):
        call(_kron_plus_diagonal())


def test_operators_storing_a_dense_matrix_do_not_warn():
    L._base._DENSE_WARNED.clear()
    M = torch.eye(4, dtype=DT) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", DenseFallbackWarning)
        torch.linalg.solve(L.DenseOperator(M), torch.ones(4, dtype=DT))
        torch.logdet(L.DenseOperator(M, positive_definite=True).mT)
        torch.linalg.solve(L.TriangularOperator(M), torch.ones(4, dtype=DT))
