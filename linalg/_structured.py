"""Toeplitz (FFT matvec) and factored operators: Cholesky ``L L^H`` and root ``R R^H``."""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch
from ._composite import as_operator
from ._dense import TriangularOperator, _scaled_props, dense_inv, dense_slogdet, dense_solve
from ._rules import add, cholesky, diagonal, inv, scale, slogdet, solve, trace


class ToeplitzOperator(LinearOperator):
    """A Toeplitz matrix ``T[i, j] = column[i - j]`` (i >= j), ``row[j - i]`` (j > i).

    Matmul embeds ``T`` in a circulant matrix of size 2n and uses the FFT: O(n log n) per
    column, O(n) memory. ``row=None`` means symmetric (``row = column``). Solves are dense
    unless an iterative method is asked for (`functransforms.linalg.iterative`).

    Args:
        column: first column, ``(..., n)``. row: first row, ``(..., n)`` (``row[0]`` is ignored).

    Example:
        >>> import torch
        >>> from functransforms.linalg import ToeplitzOperator
        >>> T = ToeplitzOperator(torch.tensor([2.0, 1.0, 0.0]))  # [3, 3], symmetric
        >>> (T @ torch.ones(3)).tolist()  # [3]
        [3.0, 4.0, 3.0]
    """

    _tree_fields = ("column", "row")
    _core_ndims = (1, 1)

    def __init__(self, column: torch.Tensor, row: torch.Tensor | None = None, **props):
        call = "ToeplitzOperator(column, row)"
        if not isinstance(column, torch.Tensor) or column.dim() < 1:
            raise TypeError(
                f"{call}: expected `column` to be a tensor of shape (..., n), received {column!r}."
            )
        if row is not None and (
            not isinstance(row, torch.Tensor) or row.shape[-1:] != column.shape[-1:]
        ):
            raise ValueError(
                f"{call}: expected `row` of shape (..., {column.shape[-1]}), received "
                f"{tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__}."
            )
        if row is None and not column.is_complex():
            props["symmetric"] = True
        self.column, self.row = column, row
        n = column.shape[-1]
        batch = broadcast_batch(column.shape[:-1], () if row is None else row.shape[:-1])
        super().__init__(batch + (n, n), column.dtype, column.device, **props)

    def _r(self):
        return self.column if self.row is None else self.row

    def _circulant(self):
        """First column of the 2n circulant embedding: ``[c_0..c_{n-1}, 0, r_{n-1}..r_1]``."""
        c, r = self.column, self._r()
        batch = broadcast_batch(c.shape[:-1], r.shape[:-1])
        c, r = c.expand(batch + c.shape[-1:]), r.expand(batch + r.shape[-1:])
        return torch.cat([c, torch.zeros_like(c[..., :1]), r[..., 1:].flip(-1)], dim=-1)

    def _matmul(self, X):
        n = self.shape[-1]
        v = self._circulant()  # (..., 2n)
        Xt = X.mT  # (..., k, n)
        if self.is_complex or X.is_complex():
            y = torch.fft.ifft(torch.fft.fft(v, n=2 * n).unsqueeze(-2) * torch.fft.fft(Xt, n=2 * n))
        else:
            y = torch.fft.irfft(
                torch.fft.rfft(v, n=2 * n).unsqueeze(-2) * torch.fft.rfft(Xt, n=2 * n), n=2 * n
            )
        return y[..., :n].mT

    def _to_dense(self):
        n = self.shape[-1]
        i = torch.arange(n, device=self.device)
        idx = (i.unsqueeze(-1) - i.unsqueeze(-2)) % (2 * n)  # circulant index of T[i, j]
        v = self._circulant()
        return v[..., idx]

    def _transpose(self):
        if self.row is None:
            return self
        column = torch.cat(
            [self.column[..., :1].expand(self.row.shape[:-1] + (1,)), self.row[..., 1:]], -1
        )
        return ToeplitzOperator(column, self.column, **self._props())


@diagonal.register(ToeplitzOperator)
def _diagonal_toeplitz(A):
    # a Toeplitz matrix's diagonal is its first entry
    return A.column[..., :1].expand(A.batch_shape + (A.shape[-1],))


@trace.register(ToeplitzOperator)
def _trace_toeplitz(A):
    # tr T = n c_0
    return A.shape[-1] * A.column[..., 0]


@scale.register(ToeplitzOperator)
def _scale_toeplitz(A, c):
    # c T is Toeplitz
    row = None if A.row is None else A.row * c
    return ToeplitzOperator(A.column * c, row, **_scaled_props(A, c))


@add.register(ToeplitzOperator)
def _add_toeplitz(A, B):
    # sums of Toeplitz matrices are Toeplitz
    if isinstance(B, ToeplitzOperator):
        row = None if (A.row is None and B.row is None) else A._r() + B._r()
        return ToeplitzOperator(A.column + B.column, row)
    return None


class RootOperator(LinearOperator):
    """``R R^H`` for a root ``R`` (operator or tensor of shape ``(..., n, k)``): symmetric PSD.

    Matmul is two applications of ``R``; for square ``R``, solve and logdet go through ``R``
    (``logdet(R R^H) = 2 log|det R|``). Declare ``positive_definite=True`` when ``R`` has full
    row rank.

    Example:
        >>> import torch
        >>> from functransforms.linalg import RootOperator
        >>> R = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        >>> RootOperator(R).to_dense().tolist()  # [2, 2]
        [[1.0, 1.0], [1.0, 2.0]]
    """

    _tree_fields = ("root",)

    def __init__(self, root, **props):
        root = as_operator(root, f"{type(self).__name__}(root)")
        self.root = root
        props["symmetric"] = True
        n = root.shape[-2]
        super().__init__(root.batch_shape + (n, n), root.dtype, root.device, **props)

    def _repr_extra(self):
        return repr(self.root)

    def _matmul(self, X):
        return self.root._matmul(self.root._adjoint()._matmul(X))

    def _to_dense(self):
        R = self.root._to_dense()
        return R @ R.mH

    def _transpose(self):
        return self if not self.is_complex else RootOperator(self.root._conj(), **self._props())

    def _adjoint(self):
        return self


@diagonal.register(RootOperator)
def _diagonal_root(A):
    # diag(R R^H)_i = |row i of R|^2
    R = A.root._to_dense()
    return (R * R.conj()).real.sum(-1).to(A.dtype)


@trace.register(RootOperator)
def _trace_root(A):
    # tr(R R^H) = ||R||_F^2
    return A.root._frobenius_sq().to(A.dtype)


@solve.register(RootOperator)
def _solve_root(A, B):
    if not A.root.is_square:
        return dense_solve(A, B)
    # (R R^H)^{-1} B = R^{-H} R^{-1} B
    return solve(A.root._adjoint(), solve(A.root, B))


@slogdet.register(RootOperator)
def _slogdet_root(A):
    # det(R R^H) = |det R|^2 (square R)
    if not A.root.is_square:
        return dense_slogdet(A)
    _, logabs = slogdet(A.root)
    return torch.ones_like(logabs), 2 * logabs


@inv.register(RootOperator)
def _inv_root(A):
    # (R R^H)^{-1} = R^{-H} R^{-1} (square R)
    if not A.root.is_square:
        return dense_inv(A)
    return RootOperator(inv(A.root)._adjoint(), **A._props())


class CholeskyOperator(RootOperator):
    """``L L^H`` given its Cholesky factor ``L`` (lower triangular tensor ``(..., n, n)``).

    Positive definite; solve is two triangular solves, logdet ``2 sum log|L_ii|``, and the
    Cholesky factor is ``L`` itself (no factorization).

    Example:
        >>> import torch
        >>> from functransforms.linalg import CholeskyOperator
        >>> L = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
        >>> A = CholeskyOperator(L)  # [2, 2], A = L L^T
        >>> torch.linalg.cholesky(A).to_dense().tolist()
        [[2.0, 0.0], [1.0, 1.0]]
    """

    def __init__(self, L, **props):
        if isinstance(L, torch.Tensor):
            L = TriangularOperator(L, upper=False)
        if not isinstance(L, LinearOperator) or not L.lower:
            raise TypeError(
                "CholeskyOperator(L): expected a lower triangular tensor or operator, "
                f"received {L!r}."
            )
        props["positive_definite"] = True
        super().__init__(L, **props)


@cholesky.register(CholeskyOperator)
def _cholesky_cholesky(A):
    # chol(L L^H) = L
    return A.root


@inv.register(CholeskyOperator)
def _inv_cholesky(A):
    # (L L^H)^{-1} = L^{-H} L^{-1} = R R^H with R = L^{-H} (upper triangular)
    return RootOperator(inv(A.root)._adjoint(), **A._props())
