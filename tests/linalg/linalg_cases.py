"""The operator catalog shared by the linalg tests.

Each `Case` builds an operator from a tuple of float64 parameter tensors (the leaves the
composition tests differentiate and batch over) and, independently, its dense matrix.
`to_dense()` is checked against that independent dense matrix; every other operation is
checked against the dense computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import functransforms.linalg as L
import torch

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _pd(n, g, batch=()):
    """A raw factor X; the case builds the SPD matrix `_sym(X)` from it, so that derivatives
    with respect to the parameter are unambiguous (a symmetric matrix parameter is not)."""
    return torch.randn(*batch, n, n, generator=g, dtype=DT)


def _sym(X):
    n = X.shape[-1]
    return X @ X.mT / n + torch.eye(n, dtype=DT)


def _wc(n, g, batch=()):
    """A well-conditioned nonsymmetric matrix."""
    return torch.randn(*batch, n, n, generator=g, dtype=DT) / n**0.5 + 2 * torch.eye(n, dtype=DT)


def _toeplitz_dense(c, r):
    n = c.shape[-1]
    rows = []
    for i in range(n):
        rows.append(torch.stack([c[..., i - j] if i >= j else r[..., j - i] for j in range(n)], -1))
    return torch.stack(rows, -2)


@dataclasses.dataclass
class Case:
    name: str
    params: Callable[[torch.Generator], tuple]
    build: Callable[..., L.LinearOperator]
    dense: Callable[..., torch.Tensor]
    invertible: bool = True
    pd: bool = False
    sym: bool = False
    tri: str | None = None  # "lower" / "upper"
    batched: bool = False

    def make(self, seed=0):
        p = self.params(_gen(seed))
        return p, self.build(*p)


_PERM = torch.tensor([3, 0, 4, 1, 2])


def _kron_dense(*fs):
    out = fs[0]
    for f in fs[1:]:
        out = torch.kron(out, f) if out.dim() == 2 and f.dim() == 2 else _bkron(out, f)
    return out


def _bkron(a, b):
    return (a[..., :, None, :, None] * b[..., None, :, None, :]).flatten(-4, -3).flatten(-2, -1)


CASES = [
    Case("dense", lambda g: (_wc(5, g),), lambda A: L.DenseOperator(A), lambda A: A),
    Case(
        "dense_pd",
        lambda g: (_pd(5, g),),
        lambda A: L.DenseOperator(_sym(A), positive_definite=True),
        _sym,
        pd=True,
        sym=True,
    ),
    Case(
        "diagonal_pd",
        lambda g: (torch.rand(5, generator=g, dtype=DT) + 0.5,),
        lambda d: L.DiagonalOperator(d, positive_definite=True),
        torch.diag_embed,
        pd=True,
        sym=True,
    ),
    Case(
        "diagonal_signed",
        lambda g: (torch.tensor([1.5, -0.7, 2.0, -1.2, 0.9], dtype=DT),),
        lambda d: L.DiagonalOperator(d),
        torch.diag_embed,
        sym=True,
    ),
    Case(
        "scaled_identity",
        lambda g: (torch.tensor(1.7, dtype=DT),),
        lambda s: L.ScaledIdentityOperator(s, 4, positive_definite=True),
        lambda s: s * torch.eye(4, dtype=DT),
        pd=True,
        sym=True,
    ),
    Case(
        "identity",
        lambda g: (),
        lambda: L.IdentityOperator(4, dtype=DT),
        lambda: torch.eye(4, dtype=DT),
        pd=True,
        sym=True,
    ),
    Case(
        "triangular_lower",
        lambda g: (_wc(5, g).tril(),),
        lambda A: L.TriangularOperator(A),
        torch.tril,
        tri="lower",
    ),
    Case(
        "triangular_upper",
        lambda g: (_wc(5, g).triu(),),
        lambda A: L.TriangularOperator(A, upper=True),
        torch.triu,
        tri="upper",
    ),
    Case(
        "lowrank",
        lambda g: (
            torch.randn(6, 2, generator=g, dtype=DT),
            torch.randn(6, 2, generator=g, dtype=DT),
        ),
        lambda U, V: L.LowRankOperator(U, V),
        lambda U, V: U @ V.mT,
        invertible=False,
    ),
    Case(
        "lowrank_rect",
        lambda g: (
            torch.randn(6, 2, generator=g, dtype=DT),
            torch.randn(4, 2, generator=g, dtype=DT),
        ),
        lambda U, V: L.LowRankOperator(U, V),
        lambda U, V: U @ V.mT,
        invertible=False,
    ),
    Case(
        "lowrank_plus_diag_pd",
        lambda g: (
            torch.randn(6, 2, generator=g, dtype=DT),
            torch.rand(6, generator=g, dtype=DT) + 0.5,
        ),
        lambda U, d: L.LowRankPlusDiagonalOperator(U, d, positive_definite=True),
        lambda U, d: torch.diag_embed(d) + U @ U.mT,
        pd=True,
        sym=True,
    ),
    Case(
        "lowrank_plus_diag",
        lambda g: (
            0.3 * torch.randn(6, 2, generator=g, dtype=DT),
            torch.rand(6, generator=g, dtype=DT) + 1.5,
            0.3 * torch.randn(6, 2, generator=g, dtype=DT),
        ),
        lambda U, d, V: L.LowRankPlusDiagonalOperator(U, d, V),
        lambda U, d, V: torch.diag_embed(d) + U @ V.mT,
    ),
    Case(
        "kronecker2_pd",
        lambda g: (_pd(2, g), _pd(3, g)),
        lambda A, B: L.KroneckerOperator(_sym(A), _sym(B), positive_definite=True),
        lambda A, B: _kron_dense(_sym(A), _sym(B)),
        pd=True,
        sym=True,
    ),
    Case(
        "kronecker3_pd",
        lambda g: (_pd(2, g), _pd(3, g), _pd(2, g)),
        lambda A, B, C: L.KroneckerOperator(_sym(A), _sym(B), _sym(C), positive_definite=True),
        lambda A, B, C: _kron_dense(_sym(A), _sym(B), _sym(C)),
        pd=True,
        sym=True,
    ),
    Case(
        "kronecker_nonsym",
        lambda g: (_wc(2, g), _wc(3, g)),
        lambda A, B: L.KroneckerOperator(A, B),
        _kron_dense,
    ),
    Case(
        "kronecker_plus_noise",
        lambda g: (_pd(2, g), _pd(3, g), torch.tensor(0.3, dtype=DT)),
        lambda A, B, s: (
            L.KroneckerOperator(_sym(A), _sym(B), positive_definite=True)
            + L.ScaledIdentityOperator(s, 6)
        ),
        lambda A, B, s: _kron_dense(_sym(A), _sym(B)) + s * torch.eye(6, dtype=DT),
        pd=True,
        sym=True,
    ),
    Case(
        "block_diagonal_pd",
        lambda g: (_pd(2, g), torch.rand(3, generator=g, dtype=DT) + 0.5),
        lambda A, d: L.BlockDiagonalOperator(
            [
                L.DenseOperator(_sym(A), positive_definite=True),
                L.DiagonalOperator(d, positive_definite=True),
            ]
        ),
        lambda A, d: torch.block_diag(_sym(A), torch.diag(d)),
        pd=True,
        sym=True,
    ),
    Case(
        "sum",
        lambda g: (_pd(5, g), torch.randn(5, 1, generator=g, dtype=DT)),
        lambda A, U: L.SumOperator(
            [L.DenseOperator(_sym(A), symmetric=True), L.LowRankOperator(U)]
        ),
        lambda A, U: _sym(A) + U @ U.mT,
        sym=True,
    ),
    Case(
        "product",
        lambda g: (_wc(5, g).tril(), torch.rand(5, generator=g, dtype=DT) + 0.5),
        lambda A, d: L.ProductOperator([L.TriangularOperator(A), L.DiagonalOperator(d)]),
        lambda A, d: A.tril() @ torch.diag(d),
        tri="lower",
    ),
    Case(
        "transpose",
        lambda g: (_wc(5, g),),
        lambda A: L.TransposeOperator(L.DenseOperator(A)),
        lambda A: A.mT,
    ),
    Case(
        "permutation",
        lambda g: (),
        lambda: L.PermutationOperator(_PERM, dtype=DT),
        lambda: torch.eye(5, dtype=DT)[_PERM],
    ),
    Case(
        "toeplitz_pd",
        lambda g: (torch.tensor([4.0, 1.0, 0.5, 0.3, 0.2, 0.1], dtype=DT),),
        lambda c: L.ToeplitzOperator(c, positive_definite=True),
        lambda c: _toeplitz_dense(c, c),
        pd=True,
        sym=True,
    ),
    Case(
        "toeplitz",
        lambda g: (
            torch.randn(5, generator=g, dtype=DT) + torch.tensor([4.0, 0, 0, 0, 0], dtype=DT),
            torch.randn(5, generator=g, dtype=DT),
        ),
        lambda c, r: L.ToeplitzOperator(c, r),
        lambda c, r: _toeplitz_dense(c, torch.cat([c[:1], r[1:]])),
    ),
    Case(
        "cholesky_factor",
        lambda g: (_wc(5, g).tril(),),
        lambda Lf: L.CholeskyOperator(Lf),
        lambda Lf: Lf.tril() @ Lf.tril().mT,
        pd=True,
        sym=True,
    ),
    Case(
        "root",
        lambda g: (_wc(5, g),),
        lambda R: L.RootOperator(R, positive_definite=True),
        lambda R: R @ R.mT,
        pd=True,
        sym=True,
    ),
    Case(
        "batched_dense_pd",
        lambda g: (_pd(4, g, (3,)),),
        lambda A: L.DenseOperator(_sym(A), positive_definite=True),
        _sym,
        pd=True,
        sym=True,
        batched=True,
    ),
    Case(
        "batched_kronecker",
        lambda g: (_pd(2, g, (3,)), _pd(3, g)),
        lambda A, B: L.KroneckerOperator(_sym(A), _sym(B), positive_definite=True),
        lambda A, B: _kron_dense(_sym(A), _sym(B)),
        pd=True,
        sym=True,
        batched=True,
    ),
    Case(
        "batched_lowrank_plus_diag",
        lambda g: (
            torch.randn(3, 6, 2, generator=g, dtype=DT),
            torch.rand(6, generator=g, dtype=DT) + 0.5,
        ),
        lambda U, d: L.LowRankPlusDiagonalOperator(U, d, positive_definite=True),
        lambda U, d: torch.diag_embed(d) + U @ U.mT,
        pd=True,
        sym=True,
        batched=True,
    ),
]

CASE_BY_NAME = {c.name: c for c in CASES}
