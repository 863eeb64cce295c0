"""Cases for the zero, Kronecker-sum, block, Hadamard, batch, circulant, tridiagonal and sparse
operators, in the `linalg_cases.Case` shape: parameters, the operator built from them, and an
independently built dense matrix (the ground truth)."""

from __future__ import annotations

import functransforms.linalg as L
import torch
from linalg_cases import DT, Case, _kron_dense, _pd, _sym, _wc


def _kron_sum_dense(*fs):
    out = None
    for i, f in enumerate(fs):
        mats = [torch.eye(g.shape[-1], dtype=DT) for g in fs]
        mats[i] = f
        term = _kron_dense(*mats)
        out = term if out is None else out + term
    return out


def _circulant_dense(c):
    n = c.shape[-1]
    return torch.stack([torch.roll(c, j, -1) for j in range(n)], -1)


def _tridiag_dense(lo, d, up):
    return torch.diag_embed(d) + torch.diag_embed(lo, -1) + torch.diag_embed(up, 1)


def _sym_column(c):
    # column[k] = column[n - k] (symmetric) and a dominant c_0 (positive definite)
    n = c.shape[-1]
    c = (c + torch.cat([c[..., :1], c[..., 1:].flip(-1)], -1)) / 2
    return c + n * torch.eye(n, dtype=DT)[0]


# a fixed sparsity pattern: the diagonal, a few entries off it (one repeated: they add up)
_SP_N = 6
_SP_DIAG = torch.arange(_SP_N)
_SP_I = torch.tensor([0, 1, 3, 2, 5, 0])
_SP_J = torch.tensor([2, 4, 0, 5, 1, 2])


def _sparse_rows_cols():
    return torch.cat([_SP_DIAG, _SP_I]), torch.cat([_SP_DIAG, _SP_J])


def _sparse(values, rows, cols, m, n):
    if values.dim() > 1:  # a batch sharing the pattern
        return torch.stack([_sparse(v, rows, cols, m, n) for v in values])
    return torch.zeros(m, n, dtype=DT).index_put((rows, cols), values, accumulate=True)


def _sparse_sym(d, off):
    rows = torch.cat([_SP_DIAG, _SP_I, _SP_J])
    cols = torch.cat([_SP_DIAG, _SP_J, _SP_I])
    return torch.cat([d, off, off], -1), rows, cols


def _rn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=DT)


STRUCTURED_CASES = [
    Case(
        "zero_rect",
        lambda g: (),
        lambda: L.ZeroOperator(4, 3, dtype=DT),
        lambda: torch.zeros(4, 3, dtype=DT),
        invertible=False,
    ),
    Case(
        "kronecker_sum_pd",
        lambda g: (_pd(2, g), _pd(3, g)),
        lambda A, B: L.KroneckerSumOperator(_sym(A), _sym(B), positive_definite=True),
        lambda A, B: _kron_sum_dense(_sym(A), _sym(B)),
        pd=True,
        sym=True,
    ),
    Case(
        "kronecker_sum3_sym",
        lambda g: (_pd(2, g), _pd(2, g), _pd(3, g)),
        lambda A, B, C: L.KroneckerSumOperator(
            _sym(A), -_sym(B) - 3 * torch.eye(2, dtype=DT), _sym(C), symmetric=True
        ),
        lambda A, B, C: _kron_sum_dense(_sym(A), -_sym(B) - 3 * torch.eye(2, dtype=DT), _sym(C)),
        sym=True,
    ),
    Case(
        "kronecker_sum_nonsym",
        lambda g: (_wc(2, g), _wc(3, g)),
        lambda A, B: L.KroneckerSumOperator(A, B),
        _kron_sum_dense,
    ),
    Case(
        "kronecker_sum_plus_noise",
        lambda g: (_pd(3, g), _pd(2, g), torch.tensor(0.4, dtype=DT)),
        lambda A, B, s: (
            L.KroneckerSumOperator(_sym(A), _sym(B), positive_definite=True)
            + L.ScaledIdentityOperator(s, 6)
        ),
        lambda A, B, s: _kron_sum_dense(_sym(A), _sym(B)) + s * torch.eye(6, dtype=DT),
        sym=True,
    ),
    Case(
        "block_lower",
        lambda g: (_wc(2, g), _rn(g, 3, 2), _wc(3, g).tril()),
        lambda A, C, T: L.BlockOperator([[A, None], [C, L.TriangularOperator(T)]]),
        lambda A, C, T: torch.cat(
            [torch.cat([A, torch.zeros(2, 3, dtype=DT)], -1), torch.cat([C, T.tril()], -1)], -2
        ),
    ),
    Case(
        "block_upper_pd_diag",
        lambda g: (torch.rand(2, generator=g, dtype=DT) + 0.5, _rn(g, 2, 3), _pd(3, g)),
        lambda d, B, A: L.BlockOperator(
            [[L.DiagonalOperator(d), B], [None, L.DenseOperator(_sym(A), positive_definite=True)]]
        ),
        lambda d, B, A: torch.cat(
            [
                torch.cat([torch.diag(d), B], -1),
                torch.cat([torch.zeros(3, 2, dtype=DT), _sym(A)], -1),
            ],
            -2,
        ),
    ),
    Case(
        "block_general",
        lambda g: (_wc(2, g), _rn(g, 2, 3), _rn(g, 3, 2), _wc(3, g)),
        lambda A, B, C, D: L.BlockOperator([[A, 0.3 * B], [0.3 * C, D]]),
        lambda A, B, C, D: torch.cat(
            [torch.cat([A, 0.3 * B], -1), torch.cat([0.3 * C, D], -1)], -2
        ),
    ),
    Case(
        "cat_rows",
        lambda g: (_rn(g, 2, 3), torch.rand(3, generator=g, dtype=DT)),
        lambda A, d: torch.cat([L.DenseOperator(A), L.DiagonalOperator(d)]),
        lambda A, d: torch.cat([A, torch.diag(d)], -2),
        invertible=False,
    ),
    Case(
        "hadamard_lowrank",
        lambda g: (_wc(5, g), _rn(g, 5, 2), _rn(g, 5, 2)),
        lambda A, U, V: L.DenseOperator(A) * L.LowRankOperator(U, V),
        lambda A, U, V: A * (U @ V.mT),
        invertible=False,
    ),
    Case(
        "hadamard_pd_lazy",
        lambda g: (_pd(5, g), torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1], dtype=DT)),
        lambda A, c: (
            L.DenseOperator(_sym(A), positive_definite=True)
            * L.ToeplitzOperator(c, positive_definite=True)
        ),
        lambda A, c: _sym(A) * _circ_free_toeplitz(c),
        pd=True,
        sym=True,
    ),
    Case(
        "hadamard_kronecker",
        lambda g: (_pd(2, g), _pd(3, g), _pd(2, g), _pd(3, g)),
        lambda A, B, C, D: (
            L.KroneckerOperator(_sym(A), _sym(B), positive_definite=True)
            * L.KroneckerOperator(_sym(C), _sym(D), positive_definite=True)
        ),
        lambda A, B, C, D: _kron_dense(_sym(A), _sym(B)) * _kron_dense(_sym(C), _sym(D)),
        pd=True,
        sym=True,
    ),
    Case(
        "repeat_batch",
        lambda g: (_rn(g, 2, 6, 2), torch.rand(6, generator=g, dtype=DT) + 0.5),
        lambda U, d: L.LowRankPlusDiagonalOperator(U, d, positive_definite=True).repeat(3, 1, 1),
        lambda U, d: (torch.diag_embed(d) + U @ U.mT).repeat(3, 1, 1),
        pd=True,
        sym=True,
        batched=True,
    ),
    Case(
        "repeat_matrix",
        lambda g: (_rn(g, 2, 3),),
        lambda A: L.DenseOperator(A).repeat(2, 1),
        lambda A: A.repeat(2, 1),
        invertible=False,
    ),
    Case(
        "sum_batch_lazy",
        lambda g: (_rn(g, 3, 6, 2), torch.rand(3, 6, generator=g, dtype=DT) + 0.5),
        lambda U, d: L.LowRankPlusDiagonalOperator(U, d, positive_definite=True).sum(0),
        lambda U, d: (torch.diag_embed(d) + U @ U.mT).sum(0),
        pd=True,
        sym=True,
    ),
    Case(
        "sum_batch_dense",
        lambda g: (_wc(4, g, (3,)),),
        lambda A: L.DenseOperator(A).sum(0),
        lambda A: A.sum(0),
    ),
    Case(
        "circulant",
        lambda g: (_rn(g, 6) + torch.tensor([5.0, 0, 0, 0, 0, 0], dtype=DT),),
        lambda c: L.CirculantOperator(c),
        _circulant_dense,
    ),
    Case(
        "circulant_odd_signed",
        lambda g: (_rn(g, 5) - torch.tensor([4.0, 0, 0, 0, 0], dtype=DT),),
        lambda c: L.CirculantOperator(c),
        _circulant_dense,
    ),
    Case(
        "circulant_sym_pd",
        lambda g: (torch.rand(6, generator=g, dtype=DT),),
        lambda c: L.CirculantOperator(_sym_column(c), positive_definite=True),
        lambda c: _circulant_dense(_sym_column(c)),
        pd=True,
        sym=True,
    ),
    Case(
        "tridiagonal_dominant",
        lambda g: (_rn(g, 5), _rn(g, 6).abs() + 3, _rn(g, 5)),
        lambda lo, d, up: L.TridiagonalOperator(lo, d, up),
        _tridiag_dense,
    ),
    Case(
        "tridiagonal_sym_pd",
        lambda g: (_rn(g, 6).abs() * 0.4, torch.rand(7, generator=g, dtype=DT) + 1.0),
        lambda lo, d: L.TridiagonalOperator(lo, d, positive_definite=True),
        lambda lo, d: _tridiag_dense(lo, d, lo),
        pd=True,
        sym=True,
    ),
    Case(
        "tridiagonal_general",
        lambda g: (_rn(g, 5) + 2, _rn(g, 6) * 0.1, _rn(g, 5) - 2),
        lambda lo, d, up: L.TridiagonalOperator(lo, d, up),
        _tridiag_dense,
    ),
    Case(
        "batched_tridiagonal",
        lambda g: (_rn(g, 3, 5), _rn(g, 3, 6).abs() + 3, _rn(g, 3, 5)),
        lambda lo, d, up: L.TridiagonalOperator(lo, d, up),
        _tridiag_dense,
        batched=True,
    ),
    Case(
        "batched_circulant",
        lambda g: (_rn(g, 2, 4) + torch.tensor([4.0, 0, 0, 0], dtype=DT),),
        lambda c: L.CirculantOperator(c),
        _circulant_dense,
        batched=True,
    ),
    Case(
        "sparse_general",
        lambda g: (torch.cat([_rn(g, _SP_N).abs() + 3, _rn(g, 6)]),),
        lambda v: L.SparseOperator(v, *_sparse_rows_cols(), (_SP_N, _SP_N)),
        lambda v: _sparse(v, *_sparse_rows_cols(), _SP_N, _SP_N),
    ),
    Case(
        "sparse_sym_pd",
        lambda g: (_rn(g, _SP_N).abs() + 4, _rn(g, 6) * 0.5),
        lambda d, o: L.SparseOperator(*_sparse_sym(d, o), (_SP_N, _SP_N), positive_definite=True),
        lambda d, o: _sparse(*_sparse_sym(d, o), _SP_N, _SP_N),
        pd=True,
        sym=True,
    ),
    Case(
        "sparse_rect",
        lambda g: (_rn(g, 5),),
        lambda v: L.SparseOperator(
            v, torch.tensor([0, 1, 3, 3, 2]), torch.tensor([4, 0, 1, 2, 2]), (4, 5)
        ),
        lambda v: _sparse(v, torch.tensor([0, 1, 3, 3, 2]), torch.tensor([4, 0, 1, 2, 2]), 4, 5),
        invertible=False,
    ),
    Case(
        "batched_sparse",
        lambda g: (torch.cat([_rn(g, 2, _SP_N).abs() + 3, _rn(g, 2, 6)], -1),),
        lambda v: L.SparseOperator(v, *_sparse_rows_cols(), (_SP_N, _SP_N)),
        lambda v: _sparse(v, *_sparse_rows_cols(), _SP_N, _SP_N),
        batched=True,
    ),
]


def _circ_free_toeplitz(c):
    n = c.shape[-1]
    i = torch.arange(n)
    return c[(i[:, None] - i[None, :]).abs()]


STRUCTURED_BY_NAME = {c.name: c for c in STRUCTURED_CASES}
