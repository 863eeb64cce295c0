"""Tridiagonal operators: O(n) matmul, O(n log n) solve by parallel cyclic reduction, O(n)
log determinant by cyclic reduction.

# Note [Tridiagonal solve and determinant]
*Solve.* Parallel cyclic reduction (PCR) eliminates, for every row ``i`` at once, its neighbours
at distance ``s`` (``s = 1, 2, 4, ...``): after ``ceil(log2 n)`` rounds every row is decoupled,
``x_i = d_i / b_i``. Each round is a few vectorized operations (no Python loop over n, unlike
the Thomas algorithm), and it is exact up to rounding. Like Thomas it does not pivot, so it is
used when the matrix is diagonally dominant by rows (strictly, or weakly and irreducibly) or
declared positive definite,
where elimination without pivoting is stable; any other tridiagonal matrix is solved by dense LU
with partial pivoting (torch.linalg.solve), also exact.

*Determinant.* Cyclic reduction: the odd-numbered unknowns couple only to even-numbered ones,
so ``det A = det(A_oo) det(S)`` with ``A_oo = diag(b_odd)`` and ``S`` the Schur complement on
the even unknowns, again tridiagonal (``b_i - a_i c_{i-1} / b_{i-1} - c_i a_{i+1} / b_{i+1}``,
new off-diagonals ``-a_i a_{i-1} / b_{i-1}``, ``-c_i c_{i+1} / b_{i+1}``). ``log2 n`` vectorized
rounds, log|det| accumulated as a sum of logs (no overflow: a 2000 x 2000 determinant of
1e1000 is fine). It is Gaussian elimination without pivoting on a symmetric permutation of A,
so it is used under the same condition as PCR; otherwise the dense LU determinant.
(A product of the 2x2 transfer matrices of the minors' recurrence was tried first: on the 1-D
Laplacian its matrix-matrix products lost 2e-10 relative accuracy; cyclic reduction is 1e-15.)
"""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch, read_through
from ._dense import DiagonalOperator, ScaledIdentityOperator, _scaled_props
from ._rules import add, diagonal, scale, slogdet, solve, trace


class TridiagonalOperator(LinearOperator):
    """A tridiagonal matrix from its three diagonals.

    Args:
        lower: subdiagonal ``A[i + 1, i]``, ``(..., n - 1)``.
        diag: diagonal, ``(..., n)``.
        upper: superdiagonal ``A[i, i + 1]``, ``(..., n - 1)``; None means ``upper = lower``
            (symmetric).

    Example:
        >>> import torch
        >>> from functransforms.linalg import TridiagonalOperator
        >>> n = 5
        >>> T = TridiagonalOperator(-torch.ones(n - 1), 2 * torch.ones(n))  # [5, 5], 1-D Laplacian
        >>> (T @ torch.ones(n)).tolist()  # [5]
        [1.0, 0.0, 0.0, 0.0, 1.0]
        >>> round(torch.logdet(T).item(), 6)  # det = n + 1
        1.791759
    """

    _tree_fields = ("lower_diag", "diag", "upper_diag")
    _core_ndims = (1, 1, 1)

    def __init__(self, lower_diag, diag, upper_diag=None, **props):
        call = "TridiagonalOperator(lower, diag, upper)"
        if not isinstance(diag, torch.Tensor) or diag.dim() < 1:
            raise TypeError(
                f"{call}: expected `diag` a tensor of shape (..., n), received {diag!r}."
            )
        n = diag.shape[-1]
        for name, t in (("lower", lower_diag), ("upper", upper_diag)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape[-1:] != (n - 1,)):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{call}: expected `{name}` of shape (..., {n - 1}), received {got}."
                )
        self.lower_diag, self.diag, self.upper_diag = lower_diag, diag, upper_diag
        if upper_diag is None and not diag.is_complex():
            props["symmetric"] = True
        batch = broadcast_batch(
            lower_diag.shape[:-1],
            diag.shape[:-1],
            () if upper_diag is None else upper_diag.shape[:-1],
        )
        super().__init__(batch + (n, n), diag.dtype, diag.device, **props)

    def _u(self):
        return self.lower_diag if self.upper_diag is None else self.upper_diag

    def _coeffs(self):
        """``(a, b, c)`` of shape ``batch + (n,)``: row i reads ``a_i x_{i-1} + b_i x_i +
        c_i x_{i+1}`` (``a_0 = c_{n-1} = 0``)."""
        batch = self.batch_shape
        lo, u, d = self.lower_diag, self._u(), self.diag
        zero = torch.zeros_like(d[..., :1])
        a = torch.cat([zero.expand(lo.shape[:-1] + (1,)), lo], -1)
        c = torch.cat([u, zero.expand(u.shape[:-1] + (1,))], -1)
        n = (self.shape[-1],)
        return a.expand(batch + n), d.expand(batch + n), c.expand(batch + n)

    def _matmul(self, X):
        # (A X)_i = a_i X_{i-1} + b_i X_i + c_i X_{i+1}
        a, b, c = (t.unsqueeze(-1) for t in self._coeffs())
        return b * X + a * _shift(X, 1, 0.0, -2) + c * _shift(X, -1, 0.0, -2)

    def _to_dense(self):
        a, b, c = self._coeffs()
        return (
            torch.diag_embed(b)
            + torch.diag_embed(a[..., 1:], -1)
            + torch.diag_embed(c[..., :-1], 1)
        )

    def _transpose(self):
        if self.upper_diag is None:
            return self
        return TridiagonalOperator(self.upper_diag, self.diag, self.lower_diag, **self._props())

    def _adjoint(self):
        if not self.is_complex:
            return self._transpose()
        u = self._u()
        return TridiagonalOperator(
            u.conj(), self.diag.conj(), self.lower_diag.conj(), **self._props()
        )

    def _diagonally_dominant(self):
        """Strictly diagonally dominant by rows, or weakly and irreducibly (every off-diagonal
        entry nonzero, one row strict): elimination without pivoting is stable and meets no
        zero pivot. Read on the values (all examples of a vmap at once); False when they
        cannot be read (jit's trace)."""
        a, b, c = self._coeffs()
        margin = b.abs() - a.abs() - c.abs()
        if read_through(margin, lambda m: (m > 0).all()):
            return True
        off = torch.cat([a[..., 1:], c[..., :-1]], -1)
        weak = read_through(margin, lambda m: (m >= 0).all() and (m > 0).any(-1).all())
        return weak and read_through(off, lambda o: (o != 0).all())


@diagonal.register(TridiagonalOperator)
def _diagonal_tridiagonal(A):
    return A.diag.expand(A.batch_shape + A.diag.shape[-1:])


@trace.register(TridiagonalOperator)
def _trace_tridiagonal(A):
    return A.diag.sum(-1).expand(A.batch_shape)


@scale.register(TridiagonalOperator)
def _scale_tridiagonal(A, c):
    # c T is tridiagonal
    upper = None if A.upper_diag is None else A.upper_diag * c
    return TridiagonalOperator(A.lower_diag * c, A.diag * c, upper, **_scaled_props(A, c))


@add.register(TridiagonalOperator)
def _add_tridiagonal(A, B):
    # sums of tridiagonal (and diagonal) matrices are tridiagonal
    if isinstance(B, TridiagonalOperator):
        upper = None if A.upper_diag is None and B.upper_diag is None else A._u() + B._u()
        return TridiagonalOperator(A.lower_diag + B.lower_diag, A.diag + B.diag, upper)
    if isinstance(B, (DiagonalOperator, ScaledIdentityOperator)):
        return TridiagonalOperator(
            A.lower_diag, A.diag + diagonal(B), A.upper_diag, symmetric=A.symmetric and B.symmetric
        )
    return None


def _shift(v, s, fill, dim):
    """``v`` moved by ``s`` along ``dim`` (positive: towards higher indices), padded by ``fill``."""
    n = v.shape[dim]
    pad_shape = list(v.shape)
    pad_shape[dim] = min(abs(s), n)
    pad = torch.full_like(v.narrow(dim, 0, pad_shape[dim]), fill)
    if abs(s) >= n:
        return pad
    if s > 0:
        return torch.cat([pad, v.narrow(dim, 0, n - s)], dim)
    return torch.cat([v.narrow(dim, -s, n + s), pad], dim)


def pcr_solve(a, b, c, D):
    """Parallel cyclic reduction (Note [Tridiagonal solve and determinant]): ``a, b, c`` of
    shape ``(..., n)``, ``D`` of shape ``(..., n, k)``."""
    n = b.shape[-1]
    s = 1
    while s < n:
        b_up, b_dn = _shift(b, s, 1.0, -1), _shift(b, -s, 1.0, -1)
        alpha = -a / b_up
        gamma = -c / b_dn
        a_new = alpha * _shift(a, s, 0.0, -1)
        c_new = gamma * _shift(c, -s, 0.0, -1)
        b = b + alpha * _shift(c, s, 0.0, -1) + gamma * _shift(a, -s, 0.0, -1)
        D = (
            D
            + alpha.unsqueeze(-1) * _shift(D, s, 0.0, -2)
            + gamma.unsqueeze(-1) * _shift(D, -s, 0.0, -2)
        )
        a, c = a_new, c_new
        s *= 2
    return D / b.unsqueeze(-1)


@solve.register(TridiagonalOperator)
def _solve_tridiagonal(A, B):
    # PCR when elimination without pivoting is stable, else dense LU (both exact)
    batch = broadcast_batch(A.batch_shape, B.shape[:-2])
    B = B.expand(batch + B.shape[-2:])
    if A.positive_definite or A._diagonally_dominant():
        a, b, c = A._coeffs()
        n = (A.shape[-1],)
        return pcr_solve(a.expand(batch + n), b.expand(batch + n), c.expand(batch + n), B)
    return torch.linalg.solve(A._to_dense().expand(batch + A.shape[-2:]), B)


def cr_slogdet(a, b, c):
    """``(sign, log|det|)`` by cyclic reduction (Note [Tridiagonal solve and determinant]):
    rows ``(a_i, b_i, c_i)``, shape ``(..., n)``."""
    sign = torch.ones_like(b[..., 0])
    logabs = torch.zeros_like(b[..., 0])
    while b.shape[-1] > 1:
        ae, be, ce = a[..., 0::2], b[..., 0::2], c[..., 0::2]  # kept (even) rows
        ao, bo, co = a[..., 1::2], b[..., 1::2], c[..., 1::2]  # eliminated (odd) rows
        # det A = det(A_oo) det(S), A_oo = diag(b_odd), S the Schur complement on the evens
        sign = sign * torch.sign(bo).prod(-1)
        logabs = logabs + bo.abs().log().sum(-1)
        ne, no = be.shape[-1], bo.shape[-1]
        # odd neighbours of even row 2j: 2j - 1 (odd j - 1) and 2j + 1 (odd j)
        odd = ((ao, 0.0), (bo, 1.0), (co, 0.0))  # a missing neighbour: the row (0, 1, 0)
        left = [_pad(t, 1, 0, fill)[..., :ne] for t, fill in odd]
        right = [_pad(t, 0, ne - no, fill) for t, fill in odd]
        (al, bl, cl), (ar, br, cr) = left, right
        b = be - ae * cl / bl - ce * ar / br
        a = -ae * al / bl
        c = -ce * cr / br
    sign = sign * torch.sign(b[..., 0])
    return sign, logabs + b[..., 0].abs().log()


def _pad(t, front, back, fill):
    """``t`` with ``front`` entries of ``fill`` before and ``back`` after (last dim)."""
    parts = []
    if front:
        parts.append(torch.full_like(t[..., :1], fill).expand(t.shape[:-1] + (front,)))
    parts.append(t)
    if back > 0:
        parts.append(torch.full_like(t[..., :1], fill).expand(t.shape[:-1] + (back,)))
    return torch.cat(parts, -1) if len(parts) > 1 else t


@slogdet.register(TridiagonalOperator)
def _slogdet_tridiagonal(A):
    # cyclic reduction where elimination without pivoting is stable, else dense LU
    if A.is_complex or not (A.positive_definite or A._diagonally_dominant()):
        return slogdet.dispatch(LinearOperator)(A)
    return cr_slogdet(*A._coeffs())
