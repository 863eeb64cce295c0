"""SparseOperator (Note [Sparse operators as gathers and scatters]): built from torch sparse
tensors, solved iteratively without ever forming the dense matrix, differentiated in its
values; the generic value/transform checks run in test_structured_operators.py."""

import warnings

import functransforms.linalg as L
import pytest
import torch

import functransforms as ft
from functransforms.errors import DenseFallbackWarning

DT = torch.float64


def _laplacian_2d(k):
    """The 5-point Laplacian on a k x k grid (positive definite), as a torch COO tensor."""
    n = k * k
    i = torch.arange(n)
    rows, cols, vals = [i], [i], [torch.full((n,), 4.0, dtype=DT)]
    for shift, ok in ((1, (i % k) != k - 1), (k, i < n - k)):
        a, b = i[ok], i[ok] + shift
        rows += [a, b]
        cols += [b, a]
        vals += [-torch.ones(len(a), dtype=DT)] * 2
    return torch.sparse_coo_tensor(
        torch.stack([torch.cat(rows), torch.cat(cols)]), torch.cat(vals), (n, n)
    )


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_from_torch_sparse_tensors(layout):
    S = _laplacian_2d(5)
    S = {"coo": S, "csr": S.to_sparse_csr(), "csc": S.to_sparse_csc()}[layout]
    A = L.SparseOperator.from_torch(S, positive_definite=True)
    dense = S.to_dense()
    x = torch.randn(25, 3, dtype=DT)
    torch.testing.assert_close(A @ x, dense @ x)
    torch.testing.assert_close(A.to_dense(), dense)
    torch.testing.assert_close(A.mT @ x, dense.mT @ x)
    torch.testing.assert_close(torch.diagonal(A), torch.diagonal(dense))


def test_cg_solve_never_forms_the_dense_matrix_and_is_differentiated_in_the_values():
    S = _laplacian_2d(12).coalesce()  # 144 unknowns
    idx, v0 = S.indices(), S.values()
    b = torch.randn(144, dtype=DT)

    def solve(v):
        A = L.SparseOperator(v, idx[0], idx[1], (144, 144), positive_definite=True)
        with L.iterative(solve="cg", tol=1e-12):
            return torch.linalg.solve(A, b)

    def dense_solve(v):
        M = torch.zeros(144, 144, dtype=DT).index_put((idx[0], idx[1]), v, accumulate=True)
        return torch.linalg.solve(M, b)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DenseFallbackWarning)  # no dense fallback
        x = solve(v0)
        g = ft.grad(lambda v: (solve(v) ** 2).sum())(v0)
    torch.testing.assert_close(x, dense_solve(v0))
    torch.testing.assert_close(g, torch.func.grad(lambda v: (dense_solve(v) ** 2).sum())(v0))
    t = torch.randn_like(v0)
    torch.testing.assert_close(
        ft.jvp(solve, (v0,), (t,))[1], torch.func.jvp(dense_solve, (v0,), (t,))[1]
    )


def test_exact_solve_falls_back_to_dense_with_a_warning():
    A = L.SparseOperator.from_torch(_laplacian_2d(4), positive_definite=True)
    with pytest.warns(DenseFallbackWarning, match=r"solve of SparseOperator\(nnz=64.*16 x 16"):
        torch.linalg.solve(A, torch.ones(16, dtype=DT))


def test_eigsh_of_a_sparse_operator():
    S = _laplacian_2d(10)
    A = L.SparseOperator.from_torch(S, positive_definite=True)
    vals, _ = L.eigsh(A, 3, which="SA", method="lobpcg", tol=1e-10)
    torch.testing.assert_close(vals, torch.linalg.eigvalsh(S.to_dense())[:3])


def test_vmap_over_right_hand_sides_and_values():
    S = _laplacian_2d(4).coalesce()
    idx, v = S.indices(), S.values()
    X = torch.randn(5, 16, dtype=DT)
    V = v + 0.1 * torch.rand(3, v.shape[0], dtype=DT)

    def apply(v, x):
        return L.SparseOperator(v, idx[0], idx[1], (16, 16)) @ x

    dense = torch.stack(
        [torch.zeros(16, 16, dtype=DT).index_put((idx[0], idx[1]), w, accumulate=True) for w in V]
    )
    got = ft.vmap(ft.vmap(apply, (None, 0)), (0, None))(V, X)
    torch.testing.assert_close(got, torch.einsum("bij,kj->bki", dense, X))


def test_bad_coordinates_are_refused_by_name():
    with pytest.raises(ValueError, match=r"a coordinate lies outside the 3 x 3 matrix"):
        L.SparseOperator(torch.ones(2), torch.tensor([0, 3]), torch.tensor([0, 1]), (3, 3))
    with pytest.raises(ValueError, match=r"rows, cols and values\[\.\.\., :\] of one length"):
        L.SparseOperator(torch.ones(3), torch.tensor([0, 1]), torch.tensor([0, 1]), (3, 3))
    with pytest.raises(TypeError, match=r"expected `rows` a 1-d integer tensor"):
        L.SparseOperator(torch.ones(2), torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), (3, 3))
    with pytest.raises(TypeError, match=r"from_torch\(S\): expected a 2-d torch sparse tensor"):
        L.SparseOperator.from_torch(torch.eye(3))
