"""Low-rank operators: ``U V^H`` and ``diag(d) + U V^H`` (Woodbury solve, determinant lemma)."""

from __future__ import annotations

import torch

from ._base import LinearOperator, broadcast_batch, dense_cholesky, read_through
from ._dense import (
    DiagonalOperator,
    ScaledIdentityOperator,
    _scaled_props,
    dense_inv,
    dense_slogdet,
    dense_solve,
)
from ._rules import add, diagonal, inv, matmul, scale, slogdet, solve, trace


def _check_factor(U, name, call):
    if not isinstance(U, torch.Tensor):
        raise TypeError(
            f"{call}: expected `{name}` to be a torch.Tensor, received {type(U).__name__}."
        )
    if U.dim() < 2:
        raise ValueError(
            f"{call}: expected `{name}` of shape (..., n, r), received {tuple(U.shape)}."
        )


def _herm(A, B):
    """``A^H B`` for tall factors."""
    return A.mH @ B


class LowRankOperator(LinearOperator):
    """``U V^H`` with ``U`` of shape ``(..., m, r)`` and ``V`` of shape ``(..., n, r)``.

    ``V=None`` means ``V = U`` (a symmetric positive semi-definite operator). Matmul costs
    O((m + n) r k); the operator is singular when r < n (solve falls back to dense LU).

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankOperator
        >>> U = torch.ones(4, 1)
        >>> K = LowRankOperator(U)  # [4, 4], rank 1
        >>> (K @ torch.ones(4)).tolist()  # [4]
        [4.0, 4.0, 4.0, 4.0]
    """

    _tree_fields = ("U", "V")
    _core_ndims = (2, 2)

    def __init__(self, U: torch.Tensor, V: torch.Tensor | None = None, **props):
        _check_factor(U, "U", "LowRankOperator(U, V)")
        if V is not None:
            _check_factor(V, "V", "LowRankOperator(U, V)")
            if V.shape[-1] != U.shape[-1]:
                raise ValueError(
                    f"LowRankOperator(U, V): expected U and V of one rank r, received "
                    f"{tuple(U.shape)} and {tuple(V.shape)}."
                )
        else:
            props["symmetric"] = True
        self.U, self.V = U, V
        Vt = U if V is None else V
        batch = broadcast_batch(U.shape[:-2], Vt.shape[:-2])
        super().__init__(batch + (U.shape[-2], Vt.shape[-2]), U.dtype, U.device, **props)

    @property
    def _V(self):
        return self.U if self.V is None else self.V

    def _repr_extra(self):
        return f"rank={self.U.shape[-1]}"

    def _matmul(self, X):
        return self.U @ _herm(self._V, X)

    def _rmatmul(self, X):
        return (X @ self.U) @ self._V.mH

    def _to_dense(self):
        return self.U @ self._V.mH

    def _transpose(self):
        if self.V is None:
            return self if not self.is_complex else LowRankOperator(self.U.conj())
        return LowRankOperator(self.V.conj(), self.U.conj())

    def _adjoint(self):
        return self if self.V is None else LowRankOperator(self.V, self.U)

    def _frobenius_sq(self):
        # ||U V^H||_F^2 = tr(U^H U V^H V)
        return (_herm(self.U, self.U) * _herm(self._V, self._V).mT).sum((-2, -1)).real


@diagonal.register(LowRankOperator)
def _diagonal_low_rank(A):
    # diag(U V^H)_i = sum_j U_ij conj(V_ij)
    k = min(A.shape[-2], A.shape[-1])
    return (A.U[..., :k, :] * A._V[..., :k, :].conj()).sum(-1)


@trace.register(LowRankOperator)
def _trace_low_rank(A):
    # tr(U V^H) = sum of its diagonal
    return diagonal(A).sum(-1)


@scale.register(LowRankOperator)
def _scale_low_rank(A, c):
    # c U V^H = (c U) V^H
    V = A.V if A.V is not None else A.U
    return LowRankOperator(A.U * c, V, **_scaled_props(A, c))


@add.register(LowRankOperator)
def _add_low_rank(A, B):
    # U V^H + D is low rank plus diagonal; U1 V1^H + U2 V2^H = [U1 U2] [V1 V2]^H
    if isinstance(B, DiagonalOperator):
        return LowRankPlusDiagonalOperator(A.U, B.d, A.V, **_lr_props(A, B))
    if isinstance(B, ScaledIdentityOperator):
        d = diagonal(B)
        return LowRankPlusDiagonalOperator(A.U, d, A.V, **_lr_props(A, B))
    if isinstance(B, LowRankOperator):
        return LowRankOperator(torch.cat([A.U, B.U], -1), torch.cat([A._V, B._V], -1))
    return None


@matmul.register(LowRankOperator)
def _matmul_low_rank(A, B):
    if isinstance(B, LowRankOperator):  # U1 (V1^H U2) V2^H
        return LowRankOperator(A.U @ _herm(A._V, B.U), B._V)
    return None


def _lr_props(lr: LinearOperator, diag: LinearOperator) -> dict:
    return dict(
        symmetric=lr.symmetric and diag.symmetric,
        positive_definite=lr.symmetric and diag.positive_definite,
    )


class LowRankPlusDiagonalOperator(LinearOperator):
    """``diag(d) + U V^H``: Woodbury solve and determinant-lemma logdet in O(n r^2 + r^3).

    ``V=None`` means ``V = U`` (symmetric). Declare ``positive_definite=True`` (unchecked) when
    ``d > 0`` and ``V = U``, to use a Cholesky of the r x r capacitance matrix.

    Args:
        U: ``(..., n, r)``. d: ``(..., n)``. V: ``(..., n, r)`` or None.

    Example:
        >>> import torch
        >>> from functransforms.linalg import LowRankPlusDiagonalOperator
        >>> U = torch.ones(3, 1, dtype=torch.float64)
        >>> K = LowRankPlusDiagonalOperator(U, torch.ones(3, dtype=torch.float64))  # [3, 3]
        >>> round(torch.logdet(K).item(), 6) == round(torch.log(torch.tensor(4.0)).item(), 6)
        True
    """

    _tree_fields = ("U", "d", "V")
    _core_ndims = (2, 1, 2)

    def __init__(self, U: torch.Tensor, d: torch.Tensor, V: torch.Tensor | None = None, **props):
        call = "LowRankPlusDiagonalOperator(U, d, V)"
        _check_factor(U, "U", call)
        if not isinstance(d, torch.Tensor) or d.dim() < 1 or d.shape[-1] != U.shape[-2]:
            raise ValueError(
                f"{call}: expected d of shape (..., {U.shape[-2]}), received "
                f"{tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}."
            )
        if V is not None:
            _check_factor(V, "V", call)
            if V.shape[-2:] != U.shape[-2:]:
                raise ValueError(
                    f"{call}: expected V of shape like U {tuple(U.shape)}, "
                    f"received {tuple(V.shape)}."
                )
        elif not d.is_complex():
            props["symmetric"] = True
        self.U, self.d, self.V = U, d, V
        n = U.shape[-2]
        batch = broadcast_batch(U.shape[:-2], d.shape[:-1], () if V is None else V.shape[:-2])
        super().__init__(batch + (n, n), U.dtype, U.device, **props)

    @property
    def _V(self):
        return self.U if self.V is None else self.V

    def _repr_extra(self):
        return f"rank={self.U.shape[-1]}"

    def _matmul(self, X):
        return self.d.unsqueeze(-1) * X + self.U @ _herm(self._V, X)

    def _rmatmul(self, X):
        return X * self.d.unsqueeze(-2) + (X @ self.U) @ self._V.mH

    def _to_dense(self):
        return torch.diag_embed(self.d) + self.U @ self._V.mH

    def _transpose(self):
        if self.V is None and not self.is_complex:
            return self
        return LowRankPlusDiagonalOperator(self._V.conj(), self.d, self.U.conj(), **self._props())

    def _adjoint(self):
        if self.V is None and not self.d.is_complex():
            return self
        return LowRankPlusDiagonalOperator(self._V, self.d.conj(), self.U, **self._props())

    def _capacitance(self):
        """``C = I_r + V^H D^{-1} U`` and ``D^{-1} U``."""
        DinvU = self.U / self.d.unsqueeze(-1)
        r = self.U.shape[-1]
        C = _herm(self._V, DinvU) + torch.eye(r, dtype=self.dtype, device=self.device)
        return C, DinvU


@diagonal.register(LowRankPlusDiagonalOperator)
def _diagonal_low_rank_plus_diagonal(A):
    # diag(D + U V^H) = d + diag(U V^H)
    return A.d + (A.U * A._V.conj()).sum(-1)


@scale.register(LowRankPlusDiagonalOperator)
def _scale_low_rank_plus_diagonal(A, c):
    # c (D + U V^H) = c D + (c U) V^H
    return LowRankPlusDiagonalOperator(A.U * c, A.d * c, A._V, **_scaled_props(A, c))


@add.register(LowRankPlusDiagonalOperator)
def _add_low_rank_plus_diagonal(A, B):
    # (D + U V^H) + E = (D + E) + U V^H for diagonal E
    if isinstance(B, (DiagonalOperator, ScaledIdentityOperator)):
        props = dict(symmetric=A.symmetric and B.symmetric)
        props["positive_definite"] = A.positive_definite and B.positive_definite
        return LowRankPlusDiagonalOperator(A.U, A.d + diagonal(B), A.V, **props)
    return None


def _zero_in_diagonal(A):
    """Woodbury and the determinant lemma divide by ``d``: a zero entry (the sum may still be
    invertible, e.g. diag(0, 1) + e1 e1^T = I) sends the operator to the dense algorithms,
    which gave nan before (a silent wrong result)."""
    return read_through(A.d, lambda d: (d == 0).any())


@solve.register(LowRankPlusDiagonalOperator)
def _solve_low_rank_plus_diagonal(A, B):
    # Woodbury: (D + U V^H)^{-1} B = D^{-1} B - D^{-1} U C^{-1} V^H D^{-1} B
    if _zero_in_diagonal(A):
        return dense_solve(A, B)
    C, DinvU = A._capacitance()
    DinvB = B / A.d.unsqueeze(-1)
    rhs = _herm(A._V, DinvB)
    if A.positive_definite:
        L = dense_cholesky(C, A)
        y = torch.linalg.solve_triangular(L, rhs, upper=False)
        y = torch.linalg.solve_triangular(L.mH, y, upper=True)
    else:
        y = torch.linalg.solve(C, rhs)
    return DinvB - DinvU @ y


@inv.register(LowRankPlusDiagonalOperator)
def _inv_low_rank_plus_diagonal(A):
    # (D + U V^H)^{-1} = D^{-1} + (-D^{-1} U C^{-1}) (D^{-H} V)^H
    if _zero_in_diagonal(A):
        return dense_inv(A)
    C, DinvU = A._capacitance()
    Unew = -torch.linalg.solve(C, DinvU, left=False)  # D^{-1} U C^{-1}
    return LowRankPlusDiagonalOperator(Unew, 1 / A.d, A._V / A.d.conj().unsqueeze(-1), **A._props())


@slogdet.register(LowRankPlusDiagonalOperator)
def _slogdet_low_rank_plus_diagonal(A):
    # Matrix determinant lemma: det(D + U V^H) = det(D) det(I + V^H D^{-1} U)
    if _zero_in_diagonal(A):
        return dense_slogdet(A)
    C, _ = A._capacitance()
    if A.positive_definite:
        L = dense_cholesky(C, A)
        logC = 2 * L.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
        signC = torch.ones_like(logC)
    else:
        signC, logC = torch.linalg.slogdet(C)
    d = A.d
    signD = (d / d.abs()).prod(-1) if d.is_complex() else torch.sign(d).prod(-1)
    return signD * signC, d.abs().log().sum(-1) + logC


@trace.register(LowRankPlusDiagonalOperator)
def _trace_low_rank_plus_diagonal(A):
    # tr(D + U V^H) = sum of its diagonal
    return diagonal(A).sum(-1)
